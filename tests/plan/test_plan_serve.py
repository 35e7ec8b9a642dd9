"""Serving planner: KV capacity by hand, continuous-batching identities, bad input, search."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from llmopt.cli import main
from llmopt.models.presets import get_preset
from llmopt.plan.hardware import GIB, get_cluster
from llmopt.plan.serve import Load, Scenario, ServeInputError, capacity, estimate, parse_load
from llmopt.plan.serve.capacity import KV_BLOCK_TOKENS, kv_bytes_per_token
from llmopt.plan.serve.cli import load_from_flags
from llmopt.plan.serve.search import search

M8 = get_preset("llama-3.1-8b")
H100 = get_cluster("h100", 1)


def test_kv_capacity_matches_a_hand_computation_for_gqa():
    sc = Scenario(precision="fp8", kv_dtype="fp8", tp=2, input_len=1000, output_len=1000)
    cap = capacity(M8, H100.gpu, sc)
    # Llama 3.1 8B: 32 layers, 8 KV heads of 128 dims; tp=2 -> 4 KV heads per rank, 1 B each
    assert cap.kv_bytes_per_token == 2 * 32 * 4 * 128 * 1 == 32768
    attn = 4096 * 4096 * 2 + 2 * 4096 * 1024  # q, o and k, v projections
    mlp = 3 * 4096 * 14336
    weights = 32 * (attn + mlp) / 2 * 1.0 + 2 * 128256 * 4096 * 2 / 2  # fp8 GEMMs, bf16 tables
    assert cap.weight_bytes == pytest.approx(weights, rel=1e-12)
    free = 79.2 * GIB - 1.5 * GIB - weights - cap.activation_bytes
    assert cap.kv_cache_bytes == pytest.approx(0.9 * free, rel=1e-12)
    assert cap.kv_tokens == int(0.9 * free // 32768)
    assert cap.tokens_per_sequence == 2016  # 2000 rounded up to 32-token blocks
    assert cap.max_batch_kv == cap.kv_tokens // 2016 and cap.max_batch == cap.max_batch_kv


def test_kv_heads_replicate_when_tp_exceeds_them():
    m70 = get_preset("llama-3.1-70b")  # 8 KV heads
    assert kv_bytes_per_token(m70, 8, "bf16") == 2 * 80 * 1 * 128 * 2
    assert kv_bytes_per_token(m70, 16, "bf16") == 2 * 80 * 1 * 128 * 2  # one head each
    assert kv_bytes_per_token(m70, 4, "fp8") == 2 * 80 * 2 * 128


def test_default_scenario_prints_every_figure_and_the_bound(capsys):
    assert main(["plan", "serve"]) == 0
    out = capsys.readouterr().out
    for text in ("KV capacity", "max batch", "TTFT", "ITL / TPOT", "output tokens/s"):
        assert text in out
    assert "llama-3.1-8b on 1 x H100" in out and "concurrency=32" in out
    assert "Bound: HBM bandwidth" in out  # 32 decoding sequences of an 8B model stream weights
    assert main(["plan", "serve", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bound"] == "bandwidth" and data["capacity"]["kv_bytes_per_token"] == 131072
    assert 30 < data["batch_per_replica"] < 32  # a client waiting for its first token idles
    assert data["ttft_ms"] > data["itl_ms"] > 0


def test_closed_loop_identities_and_kv_bound_queueing():
    base = Scenario(input_len=2048, output_len=2048)
    cap = capacity(M8, H100.gpu, base)
    at_cap = estimate(M8, H100, dataclasses.replace(base, load=Load("concurrency", cap.max_batch)))
    over = estimate(
        M8, H100, dataclasses.replace(base, load=Load("concurrency", 2 * cap.max_batch))
    )
    # throughput = batch / ITL; beyond the KV capacity the batch stops growing...
    assert at_cap.output_tokens_per_s == pytest.approx(at_cap.batch / at_cap.itl_s)
    assert over.batch == at_cap.batch == cap.max_batch
    assert over.output_tokens_per_s == pytest.approx(at_cap.output_tokens_per_s)
    # ...and the extra clients queue (C - B) / X for a slot before their prefill
    extra = cap.max_batch / at_cap.request_rate
    assert over.ttft_s - at_cap.ttft_s == pytest.approx(extra)
    assert over.bound == "KV capacity" and "KV capacity" in over.explanation[-1]
    small = estimate(M8, H100, dataclasses.replace(base, load=Load("concurrency", 8)))
    assert small.output_tokens_per_s < at_cap.output_tokens_per_s and small.itl_s < at_cap.itl_s
    # below the cap each client cycles TTFT + O·ITL, decoding for O·ITL of it
    decode = 2048 * small.itl_s
    assert small.batch == pytest.approx(8 * decode / (small.ttft_s + decode), rel=1e-6)
    assert small.output_tokens_per_s == pytest.approx(8 * 2048 / (small.ttft_s + decode), rel=1e-6)


def test_request_rate_obeys_littles_law_and_reports_overload():
    est = estimate(M8, H100, Scenario(load=Load("rate", 5.0)))
    sim = est.simulation
    # the replayed benchmark: sequences decoding on average = completions/s x the time each
    # spends decoding (O - 1 streamed gaps of mean ITL), exactly, under the mixed scheduler
    assert est.batch == pytest.approx(sim.request_rate * 255 * sim.mean_itl_s, rel=1e-9)
    # a benchmark of 1,000 Poisson requests at 5 req/s completes about 5 a second
    assert sim.request_rate == pytest.approx(5.0, rel=0.1)
    busier = estimate(M8, H100, Scenario(load=Load("rate", 12.0)))
    assert busier.ttft_s > est.ttft_s and busier.batch > est.batch  # queueing grows with ρ
    hot = estimate(M8, H100, Scenario(load=Load("rate", 1e4)))
    assert (
        hot.overloaded and hot.to_dict()["ttft_ms"] is None and "OVERLOADED" in hot.explanation[1]
    )


@pytest.mark.parametrize(
    "argv, bound, words",
    [
        ([], "bandwidth", "Bound: HBM bandwidth — each iteration streams the weights"),
        (["--offline", "--input-len", "2048", "--output-len", "128"], "compute", "Bound: compute"),
        (["--offline", "--input-len", "128", "--output-len", "2048"], "KV capacity",
         "Bound: KV capacity — the cache holds"),
        (["--gpu", "h100-pcie", "--tp", "8", "--concurrency", "64"], "interconnect",
         "Bound: interconnect — TP all-reduces take"),
        (["--offline", "--max-num-seqs", "8"], "scheduler cap", "max_num_seqs=8 caps the batch"),
        (["--model", "smollm2-135m", "--concurrency", "1"], "host overhead", "host overhead"),
    ],
)  # fmt: skip
def test_the_bound_is_named_and_explained(argv, bound, words, capsys):
    assert main(["plan", "serve", "--json", *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bound"] == bound and data["explanation"][-1].startswith("Bound:")
    assert words in data["explanation"][-1]


def test_speculative_decoding_follows_leviathan():
    sc = Scenario(  # one sequence always decoding, so both runs share the batch
        spec_tokens=4, spec_acceptance=0.8, load=Load("offline"), max_num_seqs=1
    )
    assert sc.tokens_per_round == pytest.approx((1 - 0.8**5) / 0.2)
    assert Scenario(spec_tokens=3, spec_acceptance=0.0).tokens_per_round == 1.0
    plain = estimate(M8, H100, dataclasses.replace(sc, spec_tokens=0))
    spec = estimate(M8, H100, sc)
    # batch 1 is weight-bandwidth bound: verifying 5 tokens costs about one plain step
    assert 2.5 < plain.itl_s / spec.itl_s <= sc.tokens_per_round * (1 + 1e-9)
    costly = estimate(M8, H100, dataclasses.replace(sc, spec_draft_cost=1.0))
    assert costly.itl_s > plain.itl_s  # drafts as dear as the target never pay


def test_quantisation_shrinks_weights_and_decode_time():
    times, weights = {}, {}
    for p in ("bf16", "fp8", "int4-awq"):
        est = estimate(M8, H100, Scenario(precision=p, load=Load("concurrency", 1)))
        times[p], weights[p] = est.itl_s, est.capacity.weight_bytes
    assert weights["bf16"] > weights["fp8"] > weights["int4-awq"]
    assert times["bf16"] > times["fp8"] > times["int4-awq"]


def test_itl_search_respects_its_target():
    cluster = get_cluster("h100", 1)
    # closed loop: tokens/s = C / ITL, so the fastest layout is also the quickest; offline with
    # 64 sequences per replica, more replicas win throughput and more TP wins ITL
    base = Scenario(load=Load("offline"), max_num_seqs=64)
    free = search(M8, cluster, base, 8)  # no target: the highest throughput wins
    every = free.ranked + free.missed
    quickest = min(every, key=lambda e: e.itl_s)
    assert quickest.itl_s < free.best.itl_s  # so a target between them must change the answer
    target = (quickest.itl_s + free.best.itl_s) / 2 * 1e3
    bound = search(M8, cluster, base, 8, max_itl_ms=target)
    assert bound.ranked and all(e.itl_s * 1e3 <= target for e in bound.ranked)
    assert bound.missed and all(e.itl_s * 1e3 > target for e in bound.missed)
    assert free.best.scenario.tp not in {e.scenario.tp for e in bound.ranked}
    tps = [e.output_tokens_per_s for e in bound.ranked]
    assert tps == sorted(tps, reverse=True)
    assert {e.scenario.tp * e.scenario.replicas for e in every} == {8}
    m70 = search(get_preset("llama-3.1-70b"), cluster, Scenario(), 8)
    assert any("tp=1" in name and "needs" in why for name, why in m70.rejected)
    with pytest.raises(ServeInputError, match="max_itl_ms=nan"):
        search(M8, cluster, base, 8, max_itl_ms=math.nan)


def test_unreachable_target_exits_1_and_lists_the_closest(capsys):
    argv = ["plan", "serve", "--model", "llama-3.1-70b", "--num-gpus", "8", "--max-itl-ms", "1"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "no layout meets the target" in out and out.count("(misses target)") == 3
    assert "(cannot run) tp=1" in out  # 131 GiB of bf16 weights on one 80 GB GPU


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu", "tpu9"], "unknown GPU 'tpu9'"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--tp", "3"], "tp=3 does not divide the 32 attention heads"),
        (["--input-len", "0"], "input_len=0 must be a positive integer"),
        (["--output-len", "-5"], "output_len=-5 must be a positive integer"),
        (
            ["--concurrency", "4", "--request-rate", "2"],
            "--concurrency and --request-rate are exclusive",
        ),
        (["--request-rate", "nan"], "rate=nan must be a finite number"),
        (["--kv-fraction", "nan"], "kv_fraction=nan"),
        (["--max-itl-ms", "nan"], "max_itl_ms=nan"),
        (["--precision", "fp8", "--gpu", "a100"], "has no FP8 tensor cores"),
        (["--model", "llama-3.1-405b"], "needs"),
    ],
)
def test_bad_input_is_a_one_line_error(argv, message, capsys):
    assert main(["plan", "serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_unknown_precision_names_the_valid_ones():
    with pytest.raises(ServeInputError, match=r"precision 'fp4' .* bf16, fp8, int8, int4-awq"):
        Scenario(precision="fp4")
    with pytest.raises(ServeInputError, match="tp=4 does not divide the 9 attention heads"):
        capacity(get_preset("smollm2-135m"), H100.gpu, Scenario(tp=4))
    with pytest.raises(ServeInputError, match="tp=14 and the 4 KV heads"):  # 28 heads, 4 KV
        capacity(get_preset("qwen2.5-7b"), H100.gpu, Scenario(tp=14))


def test_moe_fields_come_from_the_model_config_and_ep_needs_experts():
    """The experts are ModelConfig.moe's (HF configs reach it through the planner's config
    reader, whatever their key names); a dense model has none, so ep>1 is refused."""
    from llmopt.models.presets import get_preset
    from llmopt.plan.serve.capacity import MoEShape, moe_shape

    assert moe_shape(M8) == MoEShape() and not moe_shape(M8).is_moe
    assert moe_shape(get_preset("mixtral-8x7b")) == MoEShape(8, 2, 14336, 32)
    with pytest.raises(ServeInputError, match="ep=2 needs an MoE model"):
        capacity(M8, H100.gpu, Scenario(tp=2, ep=2))


@pytest.mark.parametrize(
    "text, kind, value",
    [
        ("offline", "offline", math.inf),
        ("concurrency=64", "concurrency", 64),
        ("c=8", "concurrency", 8),
        ("16 users", "concurrency", 16),
        ("rate=2.5", "rate", 2.5),
        ("3 req/s", "rate", 3),
        ("QPS: 7", "rate", 7),
    ],
)
def test_parse_load_reads_free_text(text, kind, value):
    load = parse_load(text)
    assert (load.kind, load.value) == (kind, value)


@pytest.mark.parametrize("text", ["fast", "offline=3", "concurrency=nan", "rate=-1", "c=2.5", ""])
def test_parse_load_refuses_what_it_cannot_read(text):
    with pytest.raises(ServeInputError):
        parse_load(text)


def test_load_flags_are_exclusive_and_default_to_concurrency_32():
    assert load_from_flags(None, None, False) == Load("concurrency", 32.0)
    with pytest.raises(ServeInputError, match="--request-rate and --offline are exclusive"):
        load_from_flags(None, 2.0, True)
    assert KV_BLOCK_TOKENS == 32


def test_moe_presets_are_served_as_moe_with_ep_and_latent_kv():
    """Issue 27 item 4: MoE presets are MoE (EP accepted, only touched experts read), and
    DeepSeek-V3's KV cache is the MLA latent, not 128 heads of K and V."""
    from llmopt.models.presets import get_preset
    from llmopt.plan.hardware import get_cluster
    from llmopt.plan.serve import Scenario, estimate
    from llmopt.plan.serve.capacity import kv_bytes_per_token, moe_shape
    from llmopt.plan.serve.step import dispatch_s, weights_read

    dsv3, qwen = get_preset("deepseek-v3"), get_preset("qwen3-235b-a22b")
    assert moe_shape(qwen).num_experts == 128 and moe_shape(dsv3).moe_layers == 58
    # latent (512) + decoupled RoPE key (64) per layer, fp8: 61 * 576 bytes on every rank
    assert kv_bytes_per_token(dsv3, 8, "fp8") == 61 * 576
    sc = Scenario(precision="fp8", kv_dtype="fp8", tp=8)
    one, many = weights_read(dsv3, sc, 1), weights_read(dsv3, sc, 4096)
    assert one < 0.1 * many  # one token reads its 8 of 256 experts per block
    cluster = get_cluster("dgx-h100", 1)
    ep = estimate(qwen, cluster, Scenario(precision="fp8", tp=8, ep=8))
    tp = estimate(qwen, cluster, Scenario(precision="fp8", tp=8, ep=1))
    assert ep.scenario.ep == 8 and ep.output_tokens_per_s > 0
    assert dispatch_s(qwen, cluster, Scenario(precision="fp8", tp=8, ep=8), 256) > 0
    assert dispatch_s(qwen, cluster, Scenario(precision="fp8", tp=8, ep=1), 256) == 0
    assert ep.itl_s != tp.itl_s  # the expert mapping is priced
