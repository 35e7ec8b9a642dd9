"""`llmopt serve`: load a model, start the engine thread, serve the OpenAI API with uvicorn.

Binds 127.0.0.1 unless --host says otherwise. SIGTERM/SIGINT (handled by uvicorn) stop
accepting connections, let in-flight requests finish, then stop the engine.
"""

from __future__ import annotations

import argparse
import socket

from llmopt import cli_args
from llmopt.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server (continuous batching over a paged KV cache)",
        description="Serve /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, "
        "/health and /metrics with continuous batching over a paged KV cache.",
    )
    p.add_argument("--model", required=True, help="packaged model name, .gguf file or HF dir")
    p.add_argument("--served-model-name", default=None, help="name clients send (default --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests decoded together")
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV cache size in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--max-batched-tokens", type=int, default=512, help="tokens per step (chunked prefill)"
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="unfinished requests before 429 is answered"
    )
    p.add_argument("--ngram", type=int, default=0, help="default n-gram speculation size (0: off)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to finish on exit")
    p.set_defaults(func=run, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """What `serve` can refuse before loading the model or binding the port."""
    cli_args.text(args, "model")
    cli_args.text(args, "served_model_name")
    cli_args.text(args, "host")
    cli_args.integer(args, "port", 0, 65535)
    cli_args.integer(args, "ngram", 0)
    for dest in ("max_num_seqs", "kv_blocks", "block_size", "max_batched_tokens", "max_queue"):
        cli_args.integer(args, dest, 1)
    cli_args.number(args, "drain_timeout", 0.0)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    import torch
    import uvicorn

    from llmopt.infer.batch import Engine, EngineConfig
    from llmopt.models.loading import load_model, load_tokenizer
    from llmopt.serve.app import create_app
    from llmopt.serve.worker import EngineWorker

    config = EngineConfig(
        num_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        prefix_caching=not args.no_prefix_caching,
    )
    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(args.model)
    engine = Engine(
        model,
        config,
        eos_token_id=tokenizer.eos_token_id,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    worker = EngineWorker(engine, max_queue=args.max_queue).start()
    name = args.served_model_name or args.model
    app = create_app(
        worker, tokenizer, name, default_ngram=args.ngram, drain_timeout_s=args.drain_timeout
    )
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise UsageError(f"cannot bind {args.host}:{args.port}: {exc.strerror}") from exc
    host, port = sock.getsockname()[:2]
    kv_mib = engine.runner.k_cache.numel() * engine.runner.k_cache.element_size() * 2 / 2**20
    print(
        f"llmopt serve: {name} on http://{host}:{port} ({config.num_blocks} KV blocks of "
        f"{config.block_size} tokens, {kv_mib:.0f} MiB; max {config.max_num_seqs} sequences)",
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=int(args.drain_timeout),
            lifespan="on",
        )
    )
    server.run(sockets=[sock])
    return 0
