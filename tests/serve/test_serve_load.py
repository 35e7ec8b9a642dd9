"""`llmopt serve` under load and faults on loopback (issue 30, item 4): 64 concurrent streams x 4
requests with clients disconnecting mid-stream and oversize bodies beside them, no error and no
leaked KV block; a fault in one request fails it alone; an engine failure fails what is in
flight and turns the server unhealthy; SIGTERM mid-load drains (new requests 503) and exits;
/metrics counts each outcome. Bounded: fixed request counts, a tiny random model."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from llmopt.infer.batch import EngineConfig, ServingEngine
from llmopt.models import ModelConfig, build_model
from llmopt.serve.loadtest import read_metrics, run_load_test, serve_in_thread, wait_idle
from llmopt.serve.worker import EngineWorker

BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def _worker(tokenizer, max_num_seqs: int = 64, num_blocks: int = 512) -> EngineWorker:
    cfg = ModelConfig(
        name="load",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_seq_len=512,
        eos_token_id=tokenizer.eos_token_id,
    )
    engine = ServingEngine(
        build_model(cfg, seed=0),
        EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=max_num_seqs),
        eos_token_id=tokenizer.eos_token_id,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    return EngineWorker(engine, max_queue=512)


def _reason(metrics: dict, name: str, reason: str) -> float:
    return metrics.get(f'{name}{{reason="{reason}"}}', 0.0)


@pytest.mark.slow
def test_64_streams_with_disconnects_and_oversize_bodies(tokenizer):
    worker = _worker(tokenizer)
    with serve_in_thread(worker, tokenizer, "load", max_body_bytes=BODY_LIMIT) as url:
        report = run_load_test(
            url, "load", streams=64, per_stream=4, max_tokens=8, disconnects=8, oversize=4,
            oversize_bytes=4 * BODY_LIMIT,
        )  # fmt: skip
        metrics = read_metrics(url)
    print(json.dumps({k: report[k] for k in ("latency_p50_s", "latency_p99_s", "wall_s")}))
    assert report["requests"] == 256 and report["errors"] == 0, report["first_errors"]
    assert report["output_tokens"] == 256 * 8  # ignore_eos: every request ran to max_tokens
    assert report["latency_p50_s"] > 0 and report["latency_p99_s"] >= report["latency_p50_s"]
    assert report["disconnects"] == 8 and report["oversize_status"] == [413]
    assert report["leaked_kv_blocks"] == 0 and report["unfinished_requests"] == 0
    # every request is counted once: 256 ran to their length, 8 aborted, 4 refused unread
    assert report["finished"] == {"stop": 0, "length": 256, "abort": 8, "error": 0, "invalid": 0}
    assert report["rejected_413"] == 4
    assert metrics["llmopt_generation_tokens_total"] >= 256 * 8


def test_a_fault_in_one_request_fails_it_alone(tokenizer, monkeypatch):
    worker = _worker(tokenizer, max_num_seqs=8)
    deliver = worker._deliver
    doomed: list[str] = []

    def faulty(entry, out, now):
        if out.request_id in doomed or (not doomed and len(worker._live) >= 4):
            doomed.append(out.request_id)  # the first request seen with 4 in flight
            raise RuntimeError("injected fault in one request's output handling")
        deliver(entry, out, now)

    monkeypatch.setattr(worker, "_deliver", faulty)
    body = {"model": "load", "prompt": "Hello", "max_tokens": 12, "ignore_eos": True}
    results: list[httpx.Response] = []
    with serve_in_thread(worker, tokenizer, "load") as url:
        threads = [
            threading.Thread(
                target=lambda: results.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
            )
            for _ in range(6)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        after = httpx.post(url + "/v1/completions", json=body, timeout=60)  # still serving
        metrics = wait_idle(url)
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * 5 + [500], [r.text for r in results]
    failed = next(r for r in results if r.status_code == 500).json()["error"]
    assert failed["type"] == "server_error" and "injected fault" in failed["message"]
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 12
    assert _reason(metrics, "llmopt_requests_finished_total", "error") == 1
    assert _reason(metrics, "llmopt_requests_finished_total", "length") == 6
    assert metrics["llmopt_kv_blocks_used"] == 0


def test_an_engine_failure_fails_what_is_in_flight_and_turns_unhealthy(tokenizer, monkeypatch):
    worker = _worker(tokenizer, max_num_seqs=8)
    step = worker.engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected engine failure")
        return step()

    monkeypatch.setattr(worker.engine, "step", failing_step)
    body = {"model": "load", "prompt": "Hello", "max_tokens": 50, "ignore_eos": True}
    with serve_in_thread(worker, tokenizer, "load") as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "injected engine failure" in r.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 503 and again.headers["retry-after"] == "1"
        assert "must be restarted" in again.json()["error"]["message"]
        metrics = read_metrics(url)
    assert _reason(metrics, "llmopt_requests_finished_total", "error") == 1
    assert _reason(metrics, "llmopt_requests_rejected_total", "503") == 1
    assert metrics["llmopt_server_up"] == 0


@pytest.mark.slow
def test_sigterm_mid_load_drains_then_refuses_with_503(tmp_path):
    """A real `llmopt serve` process: SIGTERM while 16 streams run; they all finish, a request
    sent during the drain gets 503 with Retry-After, then the process exits."""
    from tests.finetune_fixtures import tiny_hf_model
    from tests.serve.test_serve import Server  # the subprocess harness of the serve tests

    model = tiny_hf_model(tmp_path / "model")
    srv = Server(model, "--kv-blocks", "256", "--max-num-seqs", "16", "--drain-timeout", "60")
    results: list[httpx.Response] = []
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True,
            "temperature": 0}  # fmt: skip

    def call():
        results.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=call) for _ in range(16)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while srv.metric("llmopt_running_requests") < 16:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        late = None
        while late is None and time.monotonic() < deadline + 60:
            try:
                late = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            except httpx.TransportError:  # the drain already ended
                break
        for t in threads:
            t.join(120)
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        srv.stop()
    assert [r.status_code for r in results] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in results)
    assert late is not None and late.status_code == 503, "no request reached the drain window"
    assert late.headers["retry-after"] == "1" and "shutting down" in late.text
