"""`llmopt serve` end to end: a real uvicorn server on an ephemeral loopback port, exercised
over HTTP (completions, chat, SSE streaming, errors, 429, disconnect, SIGTERM drain)."""

import json
import signal
import threading
import time

import httpx
import pytest

from llmopt.infer.generate import generate
from llmopt.models.loading import load_model, load_tokenizer
from tests.serve_fixtures import Server


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir):
    """A small random model with SmolLM2's real tokenizer and chat template."""
    return tiny_hf_dir(
        "small", seed=0, hidden_size=128, intermediate_size=256, max_seq_len=4096,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(model_dir, "--kv-blocks", "256", "--block-size", "16")
    yield srv
    srv.stop()


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def _events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 4096
    assert server.metric("llmopt_kv_blocks_total") == 256
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "llmopt_queue_depth",
        "llmopt_time_to_first_token_seconds_bucket",
        "llmopt_inter_token_latency_seconds_count",
        "llmopt_generation_tokens_per_second",
    ):
        assert name in text


def test_completion_equals_generate_and_stream_equals_completion(server, model_dir):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    prompt = "The quick brown fox"
    ids = tok.encode(prompt, add_bos=tok.add_bos)
    ref = generate(model, ids, max_new_tokens=12, eos_token_id=tok.eos_token_id)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(ref),
        "total_tokens": len(ids) + len(ref),
    }
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=body | {"stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == len(ref) and events[-2]["choices"] == []
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == out["choices"][0][
        "finish_reason"
    ]
    assert len(chunks) > 1


def test_chat_uses_the_chat_template_and_streams(server, model_dir):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    messages = [{"role": "user", "content": "Say hi"}]
    ids = tok.encode(tok.apply_chat_template(messages))
    ref = generate(model, ids, max_new_tokens=8, eos_token_id=tok.eos_token_id)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    out = _post(server, "/v1/chat/completions", body).json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "content": tok.decode(ref, skip_special_tokens=True),
    }
    assert out["usage"]["prompt_tokens"] == len(ids)
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60
    ) as resp:
        events = _events(resp)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert content == out["choices"][0]["message"]["content"]


def test_stop_string_cuts_the_text(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    full = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    out = _post(server, "/v1/completions", body | {"stop": stop}).json()["choices"][0]
    assert out["text"] == full[: full.index(stop)] and out["finish_reason"] == "stop"
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=body | {"stop": [stop], "stream": True},
        timeout=60,
    ) as resp:
        events = _events(resp)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == out["text"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"prompt": "hi", "model": "gpt-9"},
            "model 'gpt-9' does not exist; this server serves 'tiny'",
        ),
        (
            {"prompt": "hi", "max_tokens": 5000},
            "exceeds the model context of 4096 tokens; use max_tokens <= 4095",
        ),
        ({"prompt": "hi", "temperature": -0.5}, r"temperature=-0.5 must be in [0, 100]"),
        ({"prompt": "hi", "top_p": 0}, "top_p=0.0 must be in (0, 1]"),
        ({"prompt": "hi", "top_k": "many"}, "'top_k' must be int, got 'many'"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens=0 must be >= 1"),
        ({"prompt": "hi", "n": 0}, "'n' must be in [1, 128], got 0"),
        ({"prompt": "hi", "suffix": "!"}, "'suffix' is not supported for completions"),
        ({"prompt": 3}, "'prompt' must be a string"),
        ({"messages": []}, "'messages' must be a non-empty list"),
    ],
)
def test_bad_requests_get_400_with_openai_error_body(server, body, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(server, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_gets_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",', timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("malformed JSON body")


def _long_stream(server, max_tokens=3000):
    body = {
        "prompt": "Hello",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    return httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60)


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    with _long_stream(server) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        assert server.metric("llmopt_kv_blocks_used") > 0
    deadline = time.monotonic() + 30
    while server.metric("llmopt_running_requests") or server.metric("llmopt_kv_blocks_used"):
        assert time.monotonic() < deadline, "the disconnected request still holds KV blocks"
        time.sleep(0.1)
    text = httpx.get(server.url + "/metrics").text
    assert 'llmopt_requests_finished_total{reason="abort"} 1' in text
    assert server.metric("llmopt_generation_tokens_total") < 3000


def test_queue_full_gets_429_with_retry_after(model_dir):
    srv = Server(model_dir, "--max-queue", "1", "--max-num-seqs", "1", "--kv-blocks", "256")
    try:
        with _long_stream(srv) as resp:
            lines = resp.iter_lines()  # kept: closing the iterator would close the stream
            assert next(lines).startswith("data: ")
            r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        srv.stop()


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(model_dir):
    srv = Server(model_dir, "--kv-blocks", "128")
    result = {}

    def call():
        body = {"prompt": "Hello", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
        result["r"] = _post(srv, "/v1/completions", body)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.metric("llmopt_running_requests"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    thread.join(120)
    try:
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        srv.stop()
    r = result["r"]
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 600
    assert r.json()["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url + "/health", timeout=2)


def test_bench_serve_against_the_server_writes_json_and_png(server, tmp_path, capsys):
    from llmopt.cli import main

    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--url", server.url, "--concurrency", "1,3", "--requests", "6",
            "--time-limit", "60", "--max-tokens", "5", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny"
    assert [r["concurrency"] for r in report["levels"]] == [1, 3]
    for row in report["levels"]:
        assert row["requests"] == 6 and row["errors"] == 0
        assert row["output_tokens"] == 30  # usage trailer: ignore_eos, 5 tokens each
        assert row["ttft_p50_s"] > 0 and row["output_tokens_per_s"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "conc  reqs" in capsys.readouterr().out


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://192.168.0.1", "ftp://127.0.0.1"])
def test_bench_serve_refuses_non_loopback_urls(url, capsys):
    from llmopt.cli import main

    assert main(["bench", "serve", "--url", url, "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "only targets loopback hosts" in err or "must look like http://127.0.0.1:PORT" in err


def test_bench_serve_accepts_loopback_names():
    from llmopt.serve.bench import check_loopback

    assert check_loopback("http://localhost:9/") == "http://localhost:9"
    assert check_loopback("http://127.0.0.2:9") == "http://127.0.0.2:9"
    assert check_loopback("http://[::1]:9") == "http://[::1]:9"


def test_stream_safe_holds_back_partial_stops_and_utf8():
    from llmopt.serve.responses import stream_safe

    assert stream_safe("hello wor", ("world",)) == "hello "
    assert stream_safe("hello wor", ("xyz", "rld")) == "hello wo"
    assert stream_safe("hello", ("world",)) == "hello"
    assert stream_safe("caf\ufffd", ()) == "caf"


def test_histogram_renders_cumulative_buckets():
    from llmopt.serve.metrics import Histogram

    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = h.render("x", "help")
    assert 'x_bucket{le="0.1"} 2' in lines and 'x_bucket{le="1.0"} 3' in lines
    assert 'x_bucket{le="+Inf"} 4' in lines and "x_count 4" in lines and "x_sum 3.650000" in lines


def test_accepted_connections_have_nagle_off():
    """Streamed tokens leave at once: without TCP_NODELAY on the accepted socket, each chunk
    after the first of a kept-alive connection waited ~40 ms for the client's delayed ACK."""
    import asyncio
    import socket

    from llmopt.serve.cli import listening_socket

    sock = listening_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    seen: list[int] = []

    async def main() -> None:
        def handle(reader, writer) -> None:
            peer = writer.get_extra_info("socket")
            seen.append(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_a_taken_port_is_one_clear_error():
    from llmopt.errors import UsageError
    from llmopt.serve.cli import listening_socket

    taken = listening_socket("127.0.0.1", 0)
    taken.listen()
    with pytest.raises(UsageError, match=r"cannot bind 127\.0\.0\.1:\d+"):
        listening_socket("127.0.0.1", taken.getsockname()[1])
    taken.close()
