"""The serving engine on a GPU: eager paged attention vs CUDA-graph decode, one prepared run.

For a machine with a CUDA device (never CI). For each model and each concurrency it adds that
many requests to the engine, runs prefill, then times the decode steps:

- `eager`: the model's forward with `PagedAttention` (torch SDPA over gathered blocks),
- `cuda-graph`: single-token decode batches replayed from CUDA graphs (`DecodeAttention`),

and checks that both produce the same greedy tokens. Models: SmolLM2-135M from the packaged
GGUF (bf16), and a random-weight Llama-3-8B-shaped model (bf16) unless --no-8b.

    python benchmarks/gpu_serving.py --out runs/gpu_serving.json

Prints a table and writes JSON (and $OUT/gpu_serving.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def models(include_8b: bool):
    from llmopt.models import build_model, get_preset
    from llmopt.models.loading import load_model

    yield "smollm2-135m", load_model("smollm2-135m", dtype=torch.bfloat16, device="cuda")
    if include_8b:
        cfg = get_preset("llama-3.1-8b").replace(max_seq_len=4096)
        yield "llama-3.1-8b (random)", build_model(cfg, seed=0, device="cuda", dtype=torch.bfloat16)


def run(model, runner: str, streams: int, prompt_len: int, new_tokens: int) -> dict:
    from llmopt.infer.batch import EngineConfig, SamplingParams, ServingEngine

    blocks = streams * (-(-(prompt_len + new_tokens) // 16)) + 8
    config = EngineConfig(
        num_blocks=blocks,
        block_size=16,
        max_num_seqs=streams,
        max_batched_tokens=max(2048, prompt_len),
        prefix_caching=False,
        runner=runner,
    )
    engine = ServingEngine(model, config)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = []
    for i in range(streams):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        requests.append(engine.add_request(f"r{i}", prompt, params))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while any(len(r.output) == 0 for r in requests):  # prefill (chunked)
        engine.step()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    decoded = sum(len(r.output) - 1 for r in requests)
    return {
        "runner": engine.runner.name,
        "streams": streams,
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "decode_steps": steps,
        "decode_tokens_per_s": decoded / (t2 - t1),
        "step_ms": 1000 * (t2 - t1) / max(steps, 1),
        "tokens": [r.output for r in requests],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-8b", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_serving.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_serving.py needs a CUDA device")
    streams = [int(s) for s in args.streams.split(",")]
    rows = []
    for name, model in models(not args.no_8b):
        model.eval()
        for n in streams:
            results = {}
            for runner in ("eager", "cuda-graph"):
                run(model, runner, min(n, 2), 16, 4)  # warm-up (kernels, graph capture paths)
                results[runner] = run(model, runner, n, args.prompt_len, args.new_tokens)
            same = results["eager"]["tokens"] == results["cuda-graph"]["tokens"]
            for runner, r in results.items():
                r.pop("tokens")
                rows.append({"model": name, **r, "same_tokens_as_eager": same})
                print(
                    f"{name:24s} {runner:10s} streams {n:3d}  decode {r['decode_tokens_per_s']:9.1f} "
                    f"tok/s  step {r['step_ms']:7.2f} ms  prefill {r['prefill_s']:.3f} s  "
                    f"same tokens: {same}",
                    flush=True,
                )
        del model
        torch.cuda.empty_cache()
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    outs = [args.out] + (
        [Path(os.environ["OUT"]) / "gpu_serving.json"] if "OUT" in os.environ else []
    )
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
