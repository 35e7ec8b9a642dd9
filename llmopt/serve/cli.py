"""`llmopt serve`: load a model, start the engine thread, serve the OpenAI API with uvicorn.

Binds 127.0.0.1 unless --host says otherwise. The KV cache the flags ask for is checked against
the memory there is before the model loads. SIGTERM/SIGINT drain: new requests get 503 with
Retry-After while the accepted ones finish (at most --drain-timeout seconds), then the server
stops accepting connections and exits; a second signal stops at once. Flag names follow vLLM's
where the concept is the same (`--max-num-seqs`, `--max-num-batched-tokens`, `--block-size`,
`--enable-prefix-caching`, `--served-model-name`, `--dtype`).
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

from llmopt import cli_args
from llmopt.dtypes import torch_dtype
from llmopt.errors import UsageError

MAX_BLOCK_SIZE = 1024  # tokens per KV block (vLLM offers 1..128; larger only wastes memory)
MEMORY_HEADROOM = 0.9  # the weights and KV cache may take this share of the available memory


def register(subparsers: argparse._SubParsersAction) -> None:
    from llmopt.serve.app import MAX_BODY_BYTES

    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server (continuous batching over a paged KV cache)",
        description="Serve /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, "
        "/health and /metrics with continuous batching over a paged KV cache.",
    )
    p.add_argument("--model", required=True, help="packaged model name, .gguf file or HF dir")
    p.add_argument("--served-model-name", default=None, help="name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests decoded together")
    p.add_argument(
        "--kv-blocks", type=int, default=1024, help="KV cache size in blocks of --block-size"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per engine step (chunked prefill)",
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="unfinished requests before 429 is answered"
    )
    p.add_argument(
        "--ngram",
        type=int,
        default=0,
        help="n-gram speculation size of requests that set none (0: off)",
    )
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=0,
        help="speculation turns itself off while more requests than this run (0: never)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of a shared prompt prefix",
    )
    cli_args.add_dtype(
        p,
        default="auto",
        choices=cli_args.LOAD_DTYPES,
        help="weight and KV-cache dtype; auto serves a quantized GGUF's blocks as the file holds "
        "them (the bytes llama.cpp reads) and anything else in float32",
    )
    p.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "fused", "eager", "cuda-graph"],
        help="auto: the fused CPU step when its kernels build (CUDA graphs on a GPU), else eager",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds the accepted requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="larger request bodies are refused with 413",
    )
    p.set_defaults(func=run, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """What `serve` can refuse before loading the model or binding the port."""
    cli_args.text(args, "model")
    cli_args.text(args, "served_model_name")
    cli_args.text(args, "host")
    cli_args.integer(args, "port", 0, 65535)
    cli_args.integer(args, "ngram", 0)
    cli_args.integer(args, "speculative_max_batch", 0)
    if args.threads is not None:
        cli_args.integer(args, "threads", 1)
    for dest in ("max_num_seqs", "kv_blocks", "max_num_batched_tokens", "max_queue"):
        cli_args.integer(args, dest, 1)
    cli_args.integer(args, "block_size", 1, MAX_BLOCK_SIZE)
    cli_args.integer(args, "max_body_bytes", 1)
    cli_args.number(args, "drain_timeout", 0.0)


def check_resources(args: argparse.Namespace, device: str = "cpu") -> str:
    """Refuse a KV cache (plus weights) that cannot fit, naming the flags, the bytes it needs,
    what is available and how many blocks would fit; a block larger than the model's context.
    Read from the model's config, before its weights load. The KV cache summary line."""
    import torch

    from llmopt.models.loading import load_config

    config = load_config(args.model)
    if config is None:  # a format whose config needs the weights: checked after loading
        return ""
    if args.block_size > config.max_seq_len:
        raise UsageError(
            f"--block-size {args.block_size} exceeds the model context of {config.max_seq_len} "
            f"tokens; use at most {config.max_seq_len} (vLLM uses 16)"
        )
    dtype = "float32" if args.dtype == "auto" else args.dtype  # auto: fp32 cache, at most fp32
    width = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    per_block = 2 * config.num_layers * args.block_size * config.num_kv_heads * config.head_dim
    per_block *= width
    kv_bytes = per_block * args.kv_blocks
    weights = config.num_parameters() * width
    available = available_memory(device)
    if available is not None and weights + kv_bytes > MEMORY_HEADROOM * available:
        fit = max(int((MEMORY_HEADROOM * available - weights) // per_block), 0)
        raise UsageError(
            f"--kv-blocks {args.kv_blocks} x --block-size {args.block_size} needs "
            f"{_gib(kv_bytes)} of KV cache ({args.dtype}) beside {_gib(weights)} of weights; "
            f"{_gib(available)} is available, so at most --kv-blocks {fit} fits"
        )
    return f"{_gib(kv_bytes)} KV cache"


def available_memory(device: str = "cpu") -> int | None:
    """Bytes a new allocation can take: free GPU memory, or MemAvailable on Linux."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def run(args: argparse.Namespace) -> int:
    check_args(args)
    kv_summary = check_resources(args)
    import uvicorn

    from llmopt.infer.batch import EngineConfig, ServingEngine
    from llmopt.models.loading import load_model, load_tokenizer
    from llmopt.serve.app import create_app
    from llmopt.serve.worker import EngineWorker

    config = EngineConfig(
        num_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=args.enable_prefix_caching,
        runner=args.runner,
        threads=args.threads,
        speculative_max_batch=args.speculative_max_batch,
    )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=cli_args.load_dtype(args.dtype))
    if args.block_size > model.config.max_seq_len:
        raise UsageError(
            f"--block-size {args.block_size} exceeds the model context of "
            f"{model.config.max_seq_len} tokens"
        )
    tokenizer = load_tokenizer(args.model)
    engine = ServingEngine(
        model,
        config,
        eos_token_id=tokenizer.eos_token_ids or tokenizer.eos_token_id,  # every end-of-turn id
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    worker = EngineWorker(engine, max_queue=args.max_queue).start()
    name = args.served_model_name or args.model
    app = create_app(
        worker,
        tokenizer,
        name,
        default_ngram=args.ngram,
        drain_timeout_s=args.drain_timeout,
        max_body_bytes=args.max_body_bytes,
    )
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(
        f"llmopt serve: {name} on http://{host}:{port} ({config.num_blocks} KV blocks of "
        f"{config.block_size} tokens{', ' + kv_summary if kv_summary else ''}; max "
        f"{config.max_num_seqs} sequences)",
        flush=True,
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=int(args.drain_timeout),
            lifespan="on",
        ),
        worker,
        args.drain_timeout,
    )
    server.run(sockets=[sock])
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's bound TCP socket. proto=IPPROTO_TCP: accepted connections inherit it, and
    only then does asyncio turn Nagle off on them (its check reads `sock.proto`); with proto 0
    every streamed token after the first of a kept-alive connection waits for the client's
    delayed ACK (~40 ms on Linux), so tokens arrive in bursts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot bind {host}:{port}: {exc.strerror}") from exc
    return sock


def _uvicorn_server():
    import uvicorn

    return uvicorn.Server


class DrainingServer(_uvicorn_server()):  # type: ignore[misc]
    """uvicorn's server with a drain before shutdown: on the first SIGTERM/SIGINT the worker
    refuses new requests (503) while the listener stays open and the accepted requests finish
    (up to `drain_timeout_s`); then uvicorn's own graceful shutdown runs. A second signal
    goes straight to uvicorn's shutdown (a third forces it)."""

    def __init__(self, config, worker, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.worker = worker
        self.drain_timeout_s = drain_timeout_s
        self._drain_started = False

    def handle_exit(self, sig, frame) -> None:
        if self._drain_started:
            super().handle_exit(sig, frame)
            return
        self._drain_started = True
        self.worker.drain()
        threading.Thread(target=self._finish, args=(sig, frame), daemon=True).start()

    def _finish(self, sig, frame) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.worker.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the last responses' bytes leave before the listener closes
        super().handle_exit(sig, frame)
