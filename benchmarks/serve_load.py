"""The bounded load-and-fault run of `llmopt serve` (issue 30, item 4), as a benchmark.

    python benchmarks/serve_load.py [--streams 64] [--per-stream 4] [--out runs/serve_load.json]

Serves a tiny random model (SmolLM2's tokenizer) in this process on 127.0.0.1 and runs
`llmopt.serve.loadtest.run_load_test`: `--streams` concurrent streaming clients doing
`--per-stream` requests each, with clients disconnecting mid-stream and oversize bodies beside
them. Prints the end-to-end latency p50/p99, TTFT p50/p99, errors and leaked KV blocks (the
blocks still referenced once every request is done), writes the JSON. The same scenario is
asserted by tests/serve/test_serve_load.py; this script reports its numbers. Exit 1 on any error
or leaked block.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--per-stream", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per request")
    parser.add_argument("--disconnects", type=int, default=8, help="clients that leave early")
    parser.add_argument("--oversize", type=int, default=4, help="bodies over the limit")
    parser.add_argument("--out", default="runs/serve_load.json", help="JSON results")
    args = parser.parse_args(argv)

    import torch

    from llmopt.artifacts import atomic_write_json
    from llmopt.infer.batch import EngineConfig, ServingEngine
    from llmopt.models import ModelConfig, build_model
    from llmopt.models.loading import load_tokenizer
    from llmopt.serve.loadtest import run_load_test, serve_in_thread
    from llmopt.serve.worker import EngineWorker

    tokenizer = load_tokenizer("smollm2-135m")
    cfg = ModelConfig(
        name="load", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=512,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    engine = ServingEngine(
        build_model(cfg, seed=0),
        EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=args.streams),
        eos_token_id=tokenizer.eos_token_id,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    worker = EngineWorker(engine, max_queue=4 * args.streams)
    limit = 64 << 10
    with serve_in_thread(worker, tokenizer, "load", max_body_bytes=limit) as url:
        report = run_load_test(
            url, "load", streams=args.streams, per_stream=args.per_stream,
            max_tokens=args.max_tokens, disconnects=args.disconnects, oversize=args.oversize,
            oversize_bytes=4 * limit,
        )  # fmt: skip
    report["machine"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    print(f"{'streams':>7} {'requests':>8} {'errors':>6} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'TTFT p50':>8} {'TTFT p99':>8} {'tok/s':>7} {'leaked blocks':>13}")  # fmt: skip
    print(
        f"{report['streams']:>7} {report['requests']:>8} {report['errors']:>6} "
        f"{ms(report['latency_p50_s']):>7} {ms(report['latency_p99_s']):>7} "
        f"{ms(report['ttft_p50_s']):>8} {ms(report['ttft_p99_s']):>8} "
        f"{report['output_tokens_per_s']:>7.0f} {report['leaked_kv_blocks']:>13.0f}"
    )
    print(f"disconnected {report['disconnects']}, oversize bodies answered "
          f"{report['oversize_status']}, finished by reason {report['finished']}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, report)
    print(f"wrote {out}")
    clean = not report["errors"] and not report["leaked_kv_blocks"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
