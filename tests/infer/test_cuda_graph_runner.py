"""The CUDA-graph runner's buffers, padding and fallbacks, run without a graph on CPU.

On a GPU the same `_Captured.run_eager` is what the graph records; here it runs directly, so
the decode-only paged attention (`DecodeAttention`), the padding of batches up to a captured
size with scratch-slot rows, and the eager fallback for prefill steps are all checked against
the eager runner.
"""

from __future__ import annotations

import pytest

from llmopt.infer.batch import EngineConfig, SamplingParams, ServingEngine
from tests.models.test_architectures import tiny

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], list(range(20, 41)), [11, 12, 13]]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_graph_runner_decodes_exactly_as_the_eager_runner(arch):
    model = tiny(arch)
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    outs = {}
    for runner in ("eager", "cuda-graph"):
        engine = ServingEngine(model, EngineConfig(num_blocks=40, block_size=4, runner=runner))
        outs[runner] = engine.generate(PROMPTS, params)
        engine.blocks.check_all_free()
    assert outs["cuda-graph"] == outs["eager"]
    assert engine.runner.name == "cuda-graph" and not engine.runner.use_graphs


def test_graph_runner_pads_batches_to_a_captured_size_and_keeps_the_cache_clean():
    model = tiny("llama")
    engine = ServingEngine(model, EngineConfig(num_blocks=40, block_size=4, runner="cuda-graph"))
    scratch = engine.runner.scratch_slot
    assert scratch == 40 * 4  # the block past the pool, which no request holds
    engine.generate(PROMPTS[:3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert {c.size for c in engine.runner.captured.values()} >= {1, 2, 4}
    four = engine.runner.captured[4]
    assert four.slots[3].item() == scratch and four.seq_lens[3].item() == 1
    # the scratch block is never part of the pool the scheduler hands out
    assert engine.blocks.num_blocks == 40 and engine.cache.num_blocks == 41


def test_graphs_are_refused_off_cuda():
    from llmopt.infer.batch.cuda_graphs import GraphRunner
    from llmopt.models.attention.paged import PagedKVCache

    model = tiny("llama")
    cache = PagedKVCache.for_model(model, 5, 4)
    with pytest.raises(ValueError, match="CUDA graphs need the model and cache on a CUDA"):
        GraphRunner(model, cache, scratch_block=4, use_graphs=True)
