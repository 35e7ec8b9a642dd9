"""The `hf/` part of a checkpoint: a complete HF directory that transformers' `AutoTokenizer` +
`AutoModelForCausalLM`, `llmopt generate` and `--init-from` all load.

It holds config.json, model.safetensors (fp32, gathered from the masters), the tokenizer files
of the run's tokenizer and generation_config.json (BOS/EOS ids, which decide when generation
stops). With LoRA the weights are the merged model (base + adapters) and the adapters
themselves are written beside it, in PEFT's layout, to `adapter/`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmopt.artifacts import atomic_write_text
from llmopt.models.config import ModelConfig

ADAPTER_DIR = "adapter"


def generation_config(config: ModelConfig) -> dict[str, Any]:
    """HF's generation_config.json for a model config (greedy by default, as ours)."""
    eos = list(config.stop_token_ids)
    out: dict[str, Any] = {"_from_model_config": True, "do_sample": False}
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def write_hf(model, directory: Path, tokenizer_spec: str | None) -> Path:
    """config.json + weights + tokenizer files + generation_config.json, each file atomic."""
    from llmopt.models.loading import load_tokenizer, save_pretrained

    tokenizer = load_tokenizer(tokenizer_spec) if tokenizer_spec else None
    save_pretrained(model, directory, tokenizer)
    atomic_write_text(
        directory / "generation_config.json", json.dumps(generation_config(model.config), indent=2)
    )
    return directory


def hf_exporter(
    engine, grid, tokenizer_spec: str | None, lora=None, base_model: str | None = None
) -> Callable[[Path], None]:
    """The checkpoint's `consolidated(directory)` callback: a collective gather of the fp32
    masters, then rank 0 writes (see the module doc)."""

    def export(directory: Path) -> None:
        if lora is None:
            state = engine.full_state_dict()
            if grid.rank != 0:
                return
            from llmopt.models.llama import build_model

            model = build_model(engine.model.config, seed=None)
            model.load_state_dict(state, strict=False)
            write_hf(model, directory, tokenizer_spec)
            return
        from llmopt.train.lora import merged_model, save_adapter

        adapters = engine.full_params()  # fp32 masters of the adapters, full
        if grid.rank != 0:
            return
        write_hf(merged_model(engine.model, adapters), directory, tokenizer_spec)
        save_adapter(engine.model, directory.parent / ADAPTER_DIR, lora, base_model, adapters)

    return export
