"""The engine's per-request logits features against references computed from the model's own
full forward: logprobs and prompt logprobs (chunked prefill, prefix cache in play), the
repetition / frequency / presence penalties and logit bias as vLLM defines them, min-p; plain
requests keep speculating, the others never do."""

import pytest
import torch

from llmopt.infer.batch import EngineConfig, InvalidRequestError, SamplingParams, ServingEngine
from llmopt.infer.sampling import apply_penalties, logits_to_probs


def _prompts(lengths, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _log_softmax(model, ids):
    return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def _engine(model, **kw):
    config = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_batched_tokens=16)
    return ServingEngine(model, EngineConfig(**(config | kw)))


def test_logprobs_and_prompt_logprobs_equal_the_full_forward(tiny_model):
    prompts = _prompts([30, 7, 1])
    prompts.append(prompts[0][:20] + [3, 4])  # shares 5 full blocks with prompt 0 (cached)
    engine = _engine(tiny_model)
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2)
    engine.generate(prompts[:1], params)  # prompt 0's blocks are in the prefix cache now
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    for i, (prompt, r) in enumerate(zip(prompts, requests, strict=True)):
        ref = _log_softmax(tiny_model, prompt + r.output)
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            logprob, top = r.prompt_logprobs[pos]
            assert logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
            values, ids = ref[pos - 1].topk(2)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert len(r.logprobs) == len(r.output) == 6
        for j, (token, (logprob, top)) in enumerate(zip(r.output, r.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert token == row.argmax().item() and logprob == pytest.approx(row.max().item())
            assert [t for t, _ in top] == row.topk(3).indices.tolist()
        # streamed: the prompt's logprobs with the first output, then one entry per token
        steps = outputs[f"r{i}"]
        assert steps[0].prompt_logprobs == r.prompt_logprobs
        assert all(s.prompt_logprobs is None for s in steps[1:])
        assert [e for s in steps for e in s.logprobs] == r.logprobs
    assert engine.blocks.prefix_hits == 0  # these requests computed their prompts whole
    engine.generate([prompts[3]], SamplingParams(max_tokens=1))
    assert engine.blocks.prefix_hits > 0  # though the cache held their blocks
    engine.blocks.check_all_free()


def _reference_penalized(model, prompt, params, steps):
    """Greedy decoding with vLLM's penalty formulas written out longhand."""
    out = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + out]))[0, -1].float().detach()
        for token, bias in params.logit_bias:
            logits[token] += bias
        for token in set(prompt + out):
            value = logits[token]
            rp = params.repetition_penalty
            logits[token] = value / rp if value > 0 else value * rp
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token)
            logits[token] -= params.presence_penalty
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.5},
        {"frequency_penalty": 1.5},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 0.7, "presence_penalty": 1.1, "repetition_penalty": 1.3},
        {"logit_bias": ((5, 3.0), (9, -100.0))},
    ],
)
def test_penalties_and_logit_bias_match_vllm_definitions(tiny_model, penalties):
    prompts = _prompts([12, 3, 25])
    params = SamplingParams(max_tokens=12, **penalties)
    with torch.no_grad():
        ref = [_reference_penalized(tiny_model, p, params, 12) for p in prompts]
    assert _engine(tiny_model).generate(prompts, params) == ref
    plain = _engine(tiny_model).generate(prompts, SamplingParams(max_tokens=12))
    assert plain != ref  # the penalty changed the output (else the test proves nothing)


def test_logit_bias_forces_a_token(tiny_model):
    out = _engine(tiny_model).generate(
        _prompts([5]), SamplingParams(max_tokens=5, temperature=1.0, logit_bias=((7, 100.0),))
    )
    assert out == [[7] * 5]
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids \[500\] are outside"):
        _engine(tiny_model).check([1], SamplingParams(logit_bias=((500, 1.0),)))


def test_min_p_keeps_tokens_within_a_share_of_the_best():
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    full = logits.softmax(-1)[0]
    kept = full >= 0.3 * full.max()
    assert (probs[0] > 0).tolist() == kept.tolist() == [True, True, False, False]
    assert probs[0, :2] == pytest.approx(full[:2] / full[:2].sum())
    # min_p=1 leaves only the most likely token: sampling at any seed equals greedy
    sampled = logits_to_probs(logits, SamplingParams(temperature=2.0, min_p=1.0))
    assert sampled[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_one_samples_the_greedy_tokens(tiny_model):
    prompts = _prompts([9, 14])
    greedy = _engine(tiny_model).generate(prompts, SamplingParams(max_tokens=8))
    params = SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, seed=3)
    assert _engine(tiny_model).generate(prompts, params) == greedy


def test_repetition_penalty_of_one_side_only_touches_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0, 1], [])
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0]
    out = apply_penalties(
        logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [2], [3, 3, 0]
    )
    assert out.tolist() == [0.5, -2.0, 2.0, -4.0]


def test_only_plain_requests_speculate(tiny_model):
    engine = _engine(tiny_model)
    plain = engine.add_request("a", [1, 2, 3], SamplingParams(ngram=2))
    featured = engine.add_request("b", [1, 2, 3], SamplingParams(ngram=2, logprobs=1))
    assert plain.spec is not None and featured.spec is None
    with pytest.raises(InvalidRequestError, match="does not combine with logprobs"):
        from llmopt.infer.drafts import NGramDraft

        engine.add_request("c", [1], SamplingParams(min_p=0.1), draft=NGramDraft(2))
