"""The files the reliability cases build in their scratch directory: tiny models, broken
configs, a user's directory that must survive, an adapter, a finished run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

Build = Callable[[Path], list[str]]


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def tiny_hf(root: Path, name: str = "tiny") -> Path:
    """A 1-layer model with the SmolLM2 tokenizer, saved as a HF directory (about 3 MB)."""
    from llmopt.models import ModelConfig, build_model
    from llmopt.models.hf import save_directory
    from llmopt.models.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    cfg = ModelConfig(
        name=name,
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_seq_len=64,
        tie_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    directory = root / name
    save_directory(build_model(cfg, seed=0).eval(), directory)
    tokenizer.save(directory)
    return directory


def user_dir(path: Path) -> Path:
    """A directory of the user's own files, which no command may delete or change unasked."""
    write(path / "notes.txt", "years of work")
    write(path / "config.json", '{"mine": true}')
    write(path / "data" / "rows.csv", "a,b\n1,2\n")
    return path


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def hf_config(tmp: Path, **changes) -> list[str]:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not ...}
    write(tmp / "cfg" / "config.json", json.dumps(cfg))
    return ["plan", "--model", str(tmp / "cfg" / "config.json"), "--top-k", "1"]


def cluster(tmp: Path, text: str | bytes) -> list[str]:
    path = write(tmp / "cluster.toml", text)
    return ["plan", "--cluster", str(path), "--top-k", "1"]


def train_config(tmp: Path, text: str | bytes) -> list[str]:
    path = write(tmp / "run.toml", text)
    return ["train", "--config", str(path), "--steps", "1"]


def gen(model: str, *extra: str) -> list[str]:
    return ["generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "1", *extra]


def model_dir(tmp: Path, edit: Callable[[Path], None], *extra: str) -> list[str]:
    directory = tiny_hf(tmp)
    edit(directory)
    return gen(str(directory), "--eager", *extra)


def truncate(directory: Path) -> None:
    shard = directory / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def integer_weights(directory: Path) -> None:
    """Every tensor stored as int32: a checkpoint of the wrong kind, not a model."""
    import torch
    from safetensors.torch import load_file, save_file

    shard = directory / "model.safetensors"
    state = {k: (v * 100).to(torch.int32) for k, v in load_file(str(shard)).items()}
    save_file(state, str(shard))


def integer_weights_eval(tmp: Path) -> list[str]:
    directory = tiny_hf(tmp)
    integer_weights(directory)
    return ["eval", "ppl", "--model", str(directory), "--max-tokens", "32"]


def index_outside(directory: Path) -> None:
    write(directory / "model.safetensors.index.json", '{"weight_map": {"a": "../elsewhere.st"}}')


def gguf(tmp: Path, head: bytes) -> list[str]:
    path = write(tmp / "bad.gguf", head + b"\0" * 64)
    return gen(str(path))


def marker(tmp: Path, **changes) -> list[str]:
    meta = {"format": "llmopt-quant", "version": 1, "model_config": {}, "quant_config": {}}
    meta.update({"modules": {}, "weights_sha256": "0" * 64, **changes})
    write(tmp / "q" / "llmopt_quant.json", json.dumps(meta))
    return export(str(tmp / "q"), tmp)


def quantized(tmp: Path) -> Path:
    """A real RTN W4 quantize output of the tiny model (one group per channel)."""
    from llmopt.compress.quant import quantize_model, save_quantized
    from llmopt.models.loading import load_model, load_tokenizer

    base = tiny_hf(tmp, "base")
    qmodel = quantize_model(load_model(base), "rtn", bits=4, group_size=-1)
    return save_quantized(qmodel, tmp / "q", load_tokenizer(base))


def edit_module_entry(tmp: Path, **changes) -> list[str]:
    """A real quantize output whose first module entry has a value of the wrong type."""
    q = quantized(tmp)
    meta = json.loads((q / "llmopt_quant.json").read_text())
    first = next(iter(meta["modules"]))
    meta["modules"][first].update(changes)
    (q / "llmopt_quant.json").write_text(json.dumps(meta))
    return gen(str(q), "--eager")


def export(model: str, tmp: Path) -> list[str]:
    return ["export", "--model", model, "--format", "hf", "--out", str(tmp / "exported")]


def adapter(tmp: Path, base: Path) -> Path:
    """A LoRA adapter of `base` (random B), written by llmopt (with its base fingerprint)."""
    import torch

    from llmopt.models.loading import load_model
    from llmopt.train.lora import LoraSettings, apply_lora, lora_modules, save_adapter

    model = load_model(base)
    settings = LoraSettings(rank=2, alpha=4.0)
    apply_lora(model, settings)
    torch.manual_seed(0)
    for lora in lora_modules(model).values():
        torch.nn.init.normal_(lora.lora_B.weight, std=0.05)
    return save_adapter(model, tmp / "adapter", settings, str(base))


def merge_onto_other_base(tmp: Path) -> list[str]:
    from llmopt.models import build_model
    from llmopt.models.loading import load_model, load_tokenizer, save_pretrained

    base = tiny_hf(tmp, "base")
    other = tmp / "other"
    save_pretrained(build_model(load_model(base).config, seed=7), other, load_tokenizer(base))
    return ["merge", "--base", str(other), "--adapter", str(adapter(tmp, base)), "--out",
            str(tmp / "merged")]  # fmt: skip


def merge_beside_partial(tmp: Path) -> list[str]:
    base = tiny_hf(tmp, "base")
    write(tmp / "merged.partial" / "draft.txt", "the user's own")
    return ["merge", "--base", str(base), "--adapter", str(adapter(tmp, base)), "--out",
            str(tmp / "merged")]  # fmt: skip


TINY_RUN = ["--corpus", "random", "--num-layers", "1", "--hidden-size", "16", "--num-heads", "2",
            "--num-kv-heads", "1", "--seq-len", "16", "--global-batch", "1", "--micro-batch", "1",
            "--peak-tflops", "1", "--no-progress"]  # fmt: skip


def finished_run(tmp: Path) -> list[str]:
    """A 1-step run already done; resuming it with --steps 1 has nothing to do."""
    from llmopt.cli import main

    if main(["train", *TINY_RUN, "--steps", "1", "--out-dir", str(tmp / "run")]) != 0:
        raise RuntimeError("the tiny training run did not finish")
    return ["train", *TINY_RUN, "--steps", "1", "--out-dir", str(tmp / "run"), "--resume"]


def finished_distill(tmp: Path) -> list[str]:
    from llmopt.cli import main

    teacher = tiny_hf(tmp, "teacher")
    text = write(tmp / "text.txt", "In the beginning God created the heavens and the earth. " * 40)
    argv = ["distill", "--teacher", str(teacher), "--student", "init:teacher-layers=0",
            "--text", str(text), "--steps", "1", "--seq-len", "16", "--global-batch", "1",
            "--micro-batch", "1", "--warmup-steps", "0", "--no-progress", "--json",
            "--out", str(tmp / "student")]  # fmt: skip
    if main(argv) != 0:
        raise RuntimeError("the tiny distillation did not finish")
    return [*argv, "--resume"]


def chat_data(tmp: Path, *lines: str) -> list[str]:
    data = write(tmp / "chat.jsonl", "\n".join(lines) + "\n")
    return ["train", "--init-from", str(tiny_hf(tmp)), "--data", str(data), "--steps", "1",
            "--seq-len", "32", "--global-batch", "1", "--micro-batch", "1", "--no-progress",
            "--peak-tflops", "1", "--out-dir", str(tmp / "run")]  # fmt: skip


GOOD_CHAT = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
)


def recipe(tmp: Path, body: str, *extra: str) -> list[str]:
    path = write(tmp / "recipe.toml", f'model = "smollm2-135m"\nout = "{tmp / "out"}"\n{body}')
    return ["compress", "--recipe", str(path), *extra]


def one(command: str, *flags: str) -> Build:
    """A command with fixed flags (and the required ones a refusal does not depend on)."""
    base = {
        "generate": ["generate", "--prompt", "hi"],
        "eval": ["eval", "ppl"],
        "serve": ["serve", "--model", "smollm2-135m"],
        "profile": ["profile", "--out", "unused-out"],
        "plan": ["plan"],
        "estimate": ["plan", "estimate"],
        "plan serve": ["plan", "serve"],
        "train": ["train"],
        "export": ["export", "--model", "x", "--format", "hf", "--out", "unused-out"],
    }[command]
    return lambda tmp: [*base, *flags]
