"""The replayed serving benchmark (`llmopt.plan.serve.simulate`): scheduler policies,
multi-step streaming, Poisson queueing, seeded lengths, and the affine iteration model."""

from __future__ import annotations

import dataclasses

import pytest

from llmopt.models.presets import get_preset
from llmopt.plan.flops import head_flops_fwd_per_token, layer_flops_fwd_per_token
from llmopt.plan.hardware import get_cluster
from llmopt.plan.serve import Load, Scenario, ServeInputError, capacity, estimate, step
from llmopt.plan.serve.simulate import simulate
from llmopt.plan.serve.step import StepModel, gemm_flops_per_s, step_cost, weights_read

M8 = get_preset("llama-3.1-8b")
H100 = get_cluster("h100", 1)
BASE = Scenario(input_len=512, output_len=128, num_requests=300, load=Load("rate", 6.0))


def run(sc: Scenario, rate: float = 6.0):
    return simulate(M8, H100, sc, capacity(M8, H100.gpu, sc).kv_tokens, rate)


def test_replay_is_deterministic_and_seeded():
    a, b = run(BASE), run(BASE)
    assert a == b
    other = run(dataclasses.replace(BASE, seed=1))
    assert other.median_ttft_s != a.median_ttft_s
    assert a.output_tokens == 300 * 128 and a.requests == 300


def test_uniform_lengths_are_drawn_per_request():
    sc = dataclasses.replace(BASE, input_len_min=1, output_len_min=1, num_requests=2000)
    sim = run(sc)
    assert sim.output_tokens / 2000 == pytest.approx(sc.mean_output_len, rel=0.05)
    assert sc.mean_output_len == 64.5 and sc.mean_input_len == 256.5


def test_prefill_first_stretches_some_gaps_and_mixed_stretches_every_gap_a_little():
    long = dataclasses.replace(BASE, input_len=2048)
    pf = run(dataclasses.replace(long, scheduler="prefill-first"))
    mixed = run(long)
    # prefill-first: most gaps are plain decode iterations, the ones spanning a prompt are long
    assert pf.mean_itl_s > 1.15 * pf.median_itl_s
    assert pf.prefill_time_share > 0.15
    # a prompt iteration without decodes is cheaper than one that carries them: lower TTFT
    assert pf.median_ttft_s < mixed.median_ttft_s
    # the same work either way: throughput within a few per cent
    assert pf.output_tokens_per_s == pytest.approx(mixed.output_tokens_per_s, rel=0.05)


def test_multi_step_streams_groups_and_delays_new_prompts():
    one = run(dataclasses.replace(BASE, scheduler="prefill-first"))
    ten = run(dataclasses.replace(BASE, scheduler="prefill-first", multi_step=10))
    assert 7 < ten.median_itl_s / one.median_itl_s < 12  # a chunk holds up to 10 tokens
    assert ten.median_tpot_s == pytest.approx(one.median_tpot_s, rel=0.3)
    assert ten.median_ttft_s > one.median_ttft_s  # a new prompt waits for the group in flight


def test_queueing_grows_with_the_rate_and_an_overload_runs_at_capacity():
    light, busy = run(BASE, 2.0), run(BASE, 20.0)
    assert busy.mean_batch > light.mean_batch and busy.median_ttft_s > light.median_ttft_s
    flood = run(BASE, 1e5)  # every request at once: the offline batch
    offline = estimate(M8, H100, dataclasses.replace(BASE, load=Load("offline")))
    assert flood.median_ttft_s > 10 * light.median_ttft_s
    # the finite benchmark drains its tail below full batch, so it ends below the steady state
    assert 0.5 * offline.output_tokens_per_s < flood.output_tokens_per_s
    assert flood.output_tokens_per_s < 1.05 * offline.output_tokens_per_s


def test_a_request_larger_than_the_kv_cache_is_refused():
    with pytest.raises(ServeInputError, match="does not fit"):
        simulate(M8, H100, BASE, 100, 1.0)
    with pytest.raises(ServeInputError, match="rate"):
        simulate(M8, H100, BASE, 10**6, 0.0)


def test_engine_profile_scales_gpu_time_and_adds_front_end_time():
    plain = StepModel(M8, H100, BASE).cost(16, 600.0, 256, 128, 1)
    slow = StepModel(M8, H100, dataclasses.replace(BASE, engine="sglang-2024")).cost(
        16, 600.0, 256, 128, 1
    )
    gpu = lambda s: s.total_s - s.overhead_s  # noqa: E731
    assert gpu(slow) == pytest.approx(
        step.ENGINE_PROFILES["sglang-2024"].gpu_time_scale * gpu(plain)
    )
    a = run(dataclasses.replace(BASE, engine="default"), 0.2)
    b = run(dataclasses.replace(BASE, engine="vllm-2024"), 0.2)
    front = step.ENGINE_PROFILES["vllm-2024"].request_s
    assert b.median_ttft_s > a.median_ttft_s + front  # the front end, then slower kernels
    with pytest.raises(ServeInputError, match="engine 'trt' is not known"):
        Scenario(engine="trt")


@pytest.mark.parametrize(
    "name, tp", [("llama-3.1-8b", 1), ("llama-3.1-70b", 4), ("qwen3-30b-a3b", 2)]
)
def test_the_iteration_model_is_the_roofline_of_its_parts(name, tp):
    model = get_preset(name)
    cluster = get_cluster("h100", 1)
    sc = Scenario(tp=tp, input_len=512, output_len=128)
    m = StepModel(model, cluster, sc)
    for decode, ctx, pre, span, reqs in (
        (0, 0.0, 512, 256, 1),
        (24, 900.0, 0, 0, 0),
        (8, 300, 100, 50, 2),
    ):
        c = m.cost(decode, ctx, pre, span, reqs)
        assert c == step_cost(model, cluster, sc, decode, ctx, pre, span, reqs)
        tokens = decode + pre
        flops = model.num_layers * layer_flops_fwd_per_token(model, 0) * tokens
        flops += head_flops_fwd_per_token(model) * (decode + reqs)
        assert c.gemm_compute_s == pytest.approx(flops / tp / gemm_flops_per_s(cluster, "bf16"))
        assert c.weight_read_s == pytest.approx(
            weights_read(model, sc, max(1, tokens))
            / (cluster.gpu.hbm_bandwidth_gbs * 1e9 * cluster.gpu.hbm_efficiency)
        )


def test_admission_policies_trade_queueing_for_retractions_within_the_kv_cache():
    # a small cache: 40 sequences at their full 512+128 length, so a burst must queue
    sc = dataclasses.replace(BASE, scheduler="prefill-first", num_requests=400)
    kv = 40 * 640
    runs = {
        a: simulate(M8, H100, dataclasses.replace(sc, admission=a), kv, 60.0)
        for a in ("reserve", "on-demand", "estimate")
    }
    for sim in runs.values():
        assert sim.peak_kv_tokens <= kv and sim.output_tokens == 400 * 128
    assert runs["reserve"].retractions == 0
    # admitting on the prompt alone starts requests sooner, and must then retract some
    assert runs["on-demand"].median_ttft_s < runs["reserve"].median_ttft_s
    assert runs["on-demand"].retractions > 0
    # SGLang's estimate counts part of the output still to come: sooner, fewer retractions
    assert runs["estimate"].median_ttft_s < runs["reserve"].median_ttft_s
    assert runs["estimate"].retractions < runs["on-demand"].retractions
    with pytest.raises(ServeInputError, match="admission 'lazy' is not known"):
        Scenario(admission="lazy")


def test_runs_of_plain_steps_are_priced_at_once_without_changing_the_medians():
    from llmopt.plan.serve import simulate as sim_mod

    sc = dataclasses.replace(BASE, num_requests=200)
    fast = run(sc, 3.0)
    saved = sim_mod.FAST_FORWARD_STEPS
    try:
        sim_mod.FAST_FORWARD_STEPS = 1  # every decode step its own iteration
        slow = run(sc, 3.0)
    finally:
        sim_mod.FAST_FORWARD_STEPS = saved
    assert fast.iterations < slow.iterations / 3
    for name in ("median_ttft_s", "median_itl_s", "median_tpot_s", "duration_s", "mean_batch"):
        assert getattr(fast, name) == pytest.approx(getattr(slow, name), rel=0.01), name
    # a long, light benchmark stays cheap: 2,000 requests of 2,048 tokens
    long = run(dataclasses.replace(sc, num_requests=2000, output_len=2048), 0.5)
    assert long.iterations < 100_000 and long.output_tokens == 2000 * 2048
