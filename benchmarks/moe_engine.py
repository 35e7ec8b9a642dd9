"""MoE in the engine: dense vs MoE training throughput at equal active parameters, and the
share of an expert-parallel step spent in all-to-all, beside the planner's prediction.

1. Throughput (one process): a dense Llama-style model and a Mixtral-style MoE whose top_k
   experts have the dense MLP's width between them (top_k x expert width = dense width), so a
   token's matmul weights are equal (the MoE adds its router). Both train the same batch,
   fp32 AdamW; the figure is tokens per second of process CPU time (the machine is shared: CPU
   time is what this process got), medians over the timed steps.
2. EP all-to-all share (--nproc gloo processes, ep = nproc over dp, round-robin routing so
   every expert gets the same tokens, the planner's force-balanced case): the wall time spent
   inside the dispatch/combine all-to-alls over the step time, per rank, median. Beside it:
   the planner's predicted share for the same model, batch and plan on a cluster profile of
   this machine (per-process matmul throughput and gloo all-to-all bandwidth measured here),
   `ep_comm_exposed / total` of `llmopt.plan.search.estimate`.

    python benchmarks/moe_engine.py [--nproc 4] [--out runs/moe_engine.json]

Prints a table, writes JSON (with the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmopt.models import ModelConfig, build_model  # noqa: E402
from llmopt.models.moe import MoEConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dense-ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="runs/moe_engine.json")
    return p.parse_args(argv)


def configs(a) -> tuple[ModelConfig, ModelConfig]:
    base = dict(
        vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_heads=4,
        num_kv_heads=2, max_seq_len=a.seq_len,
    )  # fmt: skip
    dense = ModelConfig(name="dense", intermediate_size=a.dense_ffn, **base)
    width = a.dense_ffn // a.top_k
    moe = MoEConfig(a.experts, a.top_k, width, force_balance=True)
    return dense, ModelConfig(
        name="moe", intermediate_size=width, architecture="mixtral", moe=moe, **base
    )


def throughput(cfg: ModelConfig, a) -> dict[str, float]:
    """Tokens per CPU second and per wall second, one process, fp32 AdamW."""
    from llmopt.parallel.optim import AdamW
    from llmopt.parallel.tensor_parallel import lm_loss

    model = build_model(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len + 1), generator=gen)
    cpu, wall = [], []
    for step in range(a.warmup + a.steps):
        c0, w0 = time.process_time(), time.perf_counter()
        lm_loss(model, data[:, :-1], data[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        if step >= a.warmup:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    tokens = a.batch * a.seq_len
    active = sum(p.numel() for n, p in model.named_parameters() if "experts." not in n)
    if cfg.moe is not None:
        per_expert = 3 * cfg.hidden_size * cfg.moe.expert_ffn_hidden
        active += cfg.num_layers * cfg.moe.top_k * per_expert
    return {
        "tokens_per_cpu_s": tokens / statistics.median(cpu),
        "tokens_per_wall_s": tokens / statistics.median(wall),
        "active_params": active,
        "total_params": sum(p.numel() for p in model.parameters()),
    }


def _ep_worker(rank: int, world: int, a) -> dict[str, float]:
    """One EP training run: per-step wall time and wall time inside all-to-alls."""
    from llmopt.parallel.comm import Group
    from llmopt.parallel.engine import parallelize
    from llmopt.parallel.grid import ParallelDims, RankGrid
    from llmopt.parallel.optim import AdamW
    from llmopt.parallel.plan import ParallelPlan

    spent = [0.0]
    original = Group.all_to_all

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        original(self, *args, **kwargs)
        if self.counter.enabled:  # the token rows, not the routing counts
            spent[0] += time.perf_counter() - t0

    Group.all_to_all = timed
    _, moe_cfg = configs(a)
    grid = RankGrid.create(ParallelDims(world, ep=world))
    plan = ParallelPlan(dp=world, ep=world, micro_batch=a.batch, precision="fp32")
    engine = parallelize(build_model(moe_cfg, seed=0), grid, plan)
    opt = AdamW(engine.master_params(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    data = torch.randint(0, moe_cfg.vocab_size, (a.batch, a.seq_len + 1), generator=gen)
    shares, steps = [], []
    for step in range(a.warmup + a.steps):
        spent[0] = 0.0
        t0 = time.perf_counter()
        engine.step(data[:, :-1], data[:, 1:], opt, max_norm=1.0)
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            shares.append(spent[0] / dt)
            steps.append(dt)
    return {"share": statistics.median(shares), "step_s": statistics.median(steps)}


def _bandwidth_worker(rank: int, world: int, nbytes: int) -> float:
    """gloo all-to-all bytes per second per rank (each rank's input over the call time)."""
    import torch.distributed as dist

    x = torch.zeros(nbytes // 4)
    out = torch.empty_like(x)
    for _ in range(2):
        dist.all_to_all_single(out, x)
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x)
        times.append(time.perf_counter() - t0)
    return nbytes * (world - 1) / world / statistics.median(times)


def predicted_share(a, tflops: float, a2a_bytes_per_s: float) -> dict[str, float]:
    """The planner's ep_comm_exposed / total for this run on a profile of this machine."""
    from llmopt.parallel.plan import ParallelPlan
    from llmopt.plan.hardware import customize, get_cluster
    from llmopt.plan.search import estimate
    from llmopt.plan.workload import Workload

    _, moe_cfg = configs(a)
    cluster = customize(
        get_cluster("dgx-h100", nodes=1, gpus_per_node=a.nproc),
        **{
            "gpu.peak_bf16_tflops": tflops,
            "intra_node.bandwidth_gbs": a2a_bytes_per_s / 1e9,
            "intra_node.efficiency": 1.0,
        },
    )
    plan = ParallelPlan(dp=a.nproc, ep=a.nproc, micro_batch=a.batch, precision="bf16")
    work = Workload(seq_len=a.seq_len, global_batch=a.batch * a.nproc)
    est = estimate(moe_cfg, work, cluster, plan)
    t = est.step_time_s
    return {"share": t.get("ep_comm_exposed", 0.0) / t["total"], "step_s": t["total"]}


def main(argv=None) -> int:
    a = parse_args(argv)
    from llmopt.train.launch import spawn

    load_before = os.getloadavg()
    dense_cfg, moe_cfg = configs(a)
    dense, moe = throughput(dense_cfg, a), throughput(moe_cfg, a)
    ep = spawn(_ep_worker, a.nproc, a, timeout_s=900)
    row_bytes = a.batch * a.seq_len * a.top_k * a.hidden * 4
    bw = statistics.median(spawn(_bandwidth_worker, a.nproc, row_bytes, timeout_s=300))
    from llmopt.peaks import measure_peaks

    tflops = measure_peaks("cpu", torch.float32, matmul_n=512, copy_mib=16).flops_per_s / 1e12
    planner = predicted_share(a, tflops, bw)
    load_after = os.getloadavg()
    result = {
        "args": vars(a),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "dense": dense,
        "moe": moe,
        "moe_over_dense_tokens_per_cpu_s": moe["tokens_per_cpu_s"] / dense["tokens_per_cpu_s"],
        "ep_measured_share": statistics.median(r["share"] for r in ep),
        "ep_step_s": statistics.median(r["step_s"] for r in ep),
        "gloo_all_to_all_bytes_per_s": bw,
        "matmul_tflops_per_process": tflops,
        "planner_share": planner["share"],
        "planner_step_s": planner["step_s"],
    }
    print(f"load average before {load_before}, after {load_after}")
    print(
        f"{'model':8} {'active params':>14} {'total params':>13} {'tok/CPU s':>10} {'tok/wall s':>10}"
    )
    for name, r in (("dense", dense), ("moe", moe)):
        print(f"{name:8} {r['active_params']:>14,} {r['total_params']:>13,} "
              f"{r['tokens_per_cpu_s']:>10.0f} {r['tokens_per_wall_s']:>10.0f}")  # fmt: skip
    print(f"MoE / dense tokens per CPU second: {result['moe_over_dense_tokens_per_cpu_s']:.3f}")
    print(f"EP all-to-all share of the step (ep={a.nproc}, gloo): measured "
          f"{result['ep_measured_share']:.3f}, planner {result['planner_share']:.3f} "
          f"(profile: {tflops:.3f} TFLOP/s, all-to-all {bw / 1e6:.1f} MB/s)")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
