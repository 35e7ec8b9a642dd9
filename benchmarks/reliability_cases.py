"""The bad inputs `reliability_probe.py` runs through the real CLI (and the tests reuse).

Each case builds its files in a scratch directory and returns the argv for `llmopt`; `names`
are the strings its one-line error must contain (the flag, the file, the key), so an error
that only says "num_attention_heads" counts as vague, not clean.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Build = Callable[[Path], list[str]]


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # the fault / bad-input class the docs count
    build: Build
    names: tuple[str, ...] = ()  # what the error line must mention
    expect: int = 2  # exit status of a clean refusal
    needs_model: bool = False  # builds a tiny HF model directory (slower)
    local: bool = True  # touches only its scratch directory (the tests run only these)


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
    )
    directory = root / name
    save_directory(build_model(cfg, seed=0).eval(), directory)
    load_tokenizer("smollm2-135m").save(directory)
    return directory


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _hf_config(tmp: Path, **changes) -> list[str]:
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


def _cluster(tmp: Path, text: str | bytes) -> list[str]:
    path = write(tmp / "cluster.toml", text)
    return ["plan", "--cluster", str(path), "--top-k", "1"]


def _train(tmp: Path, text: str | bytes) -> list[str]:
    path = write(tmp / "run.toml", text)
    return ["train", "--config", str(path), "--steps", "1"]


def _gen(model: str, *extra: str) -> list[str]:
    return ["generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "1", *extra]


def _model_dir(tmp: Path, edit: Callable[[Path], None], *extra: str) -> list[str]:
    directory = tiny_hf(tmp)
    edit(directory)
    return _gen(str(directory), "--eager", *extra)


def _truncate(directory: Path) -> None:
    shard = directory / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _index_outside(directory: Path) -> None:
    write(directory / "model.safetensors.index.json", '{"weight_map": {"a": "../elsewhere.st"}}')


def _gguf(tmp: Path, head: bytes) -> list[str]:
    path = write(tmp / "bad.gguf", head + b"\0" * 64)
    return _gen(str(path))


def _marker(tmp: Path, **changes) -> list[str]:
    meta = {"format": "llmopt-quant", "version": 1, "model_config": {}, "quant_config": {}}
    meta.update({"modules": {}, "weights_sha256": "0" * 64, **changes})
    write(tmp / "q" / "llmopt_quant.json", json.dumps(meta))
    return _export(str(tmp / "q"), tmp)


def _export(model: str, tmp: Path) -> list[str]:
    return ["export", "--model", model, "--format", "hf", "--out", str(tmp / "exported")]


def _one(flag: str, value: str, command: str = "generate") -> Build:
    base = {
        "generate": ["generate", "--prompt", "hi"],
        "eval": ["eval", "ppl"],
        "serve": ["serve", "--model", "smollm2-135m"],
        "profile": ["profile", "--out", "unused-out"],
        "plan": ["plan"],
        "estimate": ["plan", "estimate"],
        "train": ["train"],
    }[command]
    return lambda tmp: [*base, flag, value]


_TRAIN_SMALL = "num_layers = 1\nhidden_size = 16\n"
# fmt: off
CASES: list[Case] = [
    # --- numeric flags whose falsy or non-finite value used to be reinterpreted ---
    Case("plan estimate --tp 0", "numeric flags", _one("--tp", "0", "estimate"), ("--tp",)),
    Case("plan --nodes 0", "numeric flags", _one("--nodes", "0", "plan"), ("--nodes",)),
    Case("plan --seq-len -1", "numeric flags", _one("--seq-len", "-1", "plan"), ("seq_len",)),
    Case("generate --threads 0", "numeric flags", _one("--threads", "0"), ("--threads",)),
    Case("generate --top-p 0", "numeric flags", _one("--top-p", "0"), ("--top-p",)),
    Case("generate --temperature nan", "numeric flags", _one("--temperature", "nan"), ("--temp",)),
    Case("generate --max-new-tokens -1", "numeric flags", _one("--max-new-tokens", "-1"), ("--max",)),
    Case("generate --gamma 0", "numeric flags", lambda t: _gen("x", "--draft", "ngram", "--gamma", "0"), ("--gamma",)),
    Case("eval ppl --stride 0", "numeric flags", _one("--stride", "0", "eval"), ("--stride",)),
    Case("eval ppl --ctx 0", "numeric flags", _one("--ctx", "0", "eval"), ("--ctx",)),
    Case("serve --port 70000", "numeric flags", _one("--port", "70000", "serve"), ("--port",)),
    Case("serve --max-num-seqs 0", "numeric flags", _one("--max-num-seqs", "0", "serve"), ("--max-num-seqs",)),
    Case("serve --drain-timeout inf", "numeric flags", _one("--drain-timeout", "inf", "serve"), ("--drain",)),
    Case("profile --new-tokens 0", "numeric flags", _one("--new-tokens", "0", "profile"), ("--new-tokens",)),
    Case("plan --peak-tflops nan", "numeric flags", _one("--peak-tflops", "nan", "plan"), ("peak",)),
    Case("plan --hbm-gib -80", "numeric flags", _one("--hbm-gib", "-80", "plan"), ("hbm",)),
    Case("plan --global-batch 0", "numeric flags", _one("--global-batch", "0", "plan"), ("global_batch",)),
    Case("train --steps -1", "numeric flags", _one("--steps", "-1", "train"), ("steps",)),
    Case("train --lr nan", "numeric flags", _one("--lr", "nan", "train"), ("lr",)),
    # --- empty strings and abbreviations ---
    Case("generate --draft ''", "empty and abbreviated flags", _one("--draft", ""), ("--draft",)),
    Case("generate --model ''", "empty and abbreviated flags", _one("--model", ""), ("--model",)),
    Case("plan --gpus 8 (abbreviation)", "empty and abbreviated flags", _one("--gpus", "8", "plan"), ("8",)),
    Case("train --zero 1 (old name)", "empty and abbreviated flags", _one("--zero", "1", "train"), ("--zero-stage",)),
    # --- text that is not UTF-8 ---
    Case("generate --prompt <0xff byte>", "non-UTF-8 text", lambda t: ["generate", "--prompt", "a\udcffb"], ("--prompt",)),
    Case("eval --text latin-1 file", "non-UTF-8 text", lambda t: ["eval", "ppl", "--text", str(write(t / "latin1.txt", b"caf\xe9 " * 50))], ("latin1.txt",)),
    Case("cluster TOML in UTF-16", "non-UTF-8 text", lambda t: _cluster(t, "nodes = 2\n".encode("utf-16")), ("cluster.toml",)),
    # --- cluster TOML ---
    Case('cluster nodes = "eight"', "cluster TOML", lambda t: _cluster(t, 'nodes = "eight"\n'), ("cluster.toml", "nodes")),
    Case("cluster nodes = true", "cluster TOML", lambda t: _cluster(t, "nodes = true\n"), ("cluster.toml", "nodes")),
    Case("cluster nodes = 0", "cluster TOML", lambda t: _cluster(t, "nodes = 0\n"), ("cluster.toml", "nodes")),
    Case('cluster [gpu] hbm_gib = "80"', "cluster TOML", lambda t: _cluster(t, '[gpu]\nhbm_gib = "80"\n'), ("cluster.toml", "hbm_gib")),
    Case("cluster [gpu] hbm_gib = nan", "cluster TOML", lambda t: _cluster(t, "[gpu]\nhbm_gib = nan\n"), ("cluster.toml", "hbm_gib")),
    Case("cluster unknown key", "cluster TOML", lambda t: _cluster(t, "nodez = 2\n"), ("cluster.toml", "nodez")),
    Case("cluster gpu = 3 (not a table)", "cluster TOML", lambda t: _cluster(t, "gpu = 3\n"), ("cluster.toml", "gpu")),
    Case("cluster invalid TOML", "cluster TOML", lambda t: _cluster(t, "nodes = = 2\n"), ("cluster.toml",)),
    Case("cluster file missing", "cluster TOML", lambda t: ["plan", "--cluster", str(t / "none.toml")], ("none.toml",)),
    # --- training config TOML ---
    Case('train steps = "5"', "training config", lambda t: _train(t, 'steps = "5"\n'), ("run.toml", "steps")),
    Case("train zero_stage = true", "training config", lambda t: _train(t, "zero_stage = true\n"), ("run.toml", "zero_stage")),
    Case("train zero = true (old key)", "training config", lambda t: _train(t, "zero = true\n"), ("run.toml", "zero_stage")),
    Case("train lr = inf", "training config", lambda t: _train(t, "lr = inf\n"), ("run.toml", "lr")),
    Case("train [parallel] tp = 1.5", "training config", lambda t: _train(t, "[parallel]\ntp = 1.5\n"), ("run.toml", "tp")),
    Case("train unknown key", "training config", lambda t: _train(t, _TRAIN_SMALL + "stepz = 3\n"), ("run.toml", "stepz")),
    Case("train JSON config with NaN", "training config", lambda t: ["train", "--config", str(write(t / "run.json", '{"lr": NaN}'))], ("run.json",)),
    # --- HF config.json ---
    Case("config.json lacks num_attention_heads", "HF config.json", lambda t: _hf_config(t, num_attention_heads=...), ("config.json", "num_attention_heads")),
    Case('config.json hidden_size = "64"', "HF config.json", lambda t: _hf_config(t, hidden_size="64"), ("config.json", "hidden_size")),
    Case("config.json num_hidden_layers = true", "HF config.json", lambda t: _hf_config(t, num_hidden_layers=True), ("config.json", "num_hidden_layers")),
    Case('config.json rms_norm_eps = "1e-5"', "HF config.json", lambda t: _hf_config(t, rms_norm_eps="1e-5"), ("config.json", "rms_norm_eps")),
    Case("config.json is a list", "HF config.json", lambda t: ["plan", "--model", str(write(t / "c" / "config.json", "[1, 2]"))], ("config.json",)),
    Case("config.json truncated", "HF config.json", lambda t: ["plan", "--model", str(write(t / "c" / "config.json", '{"vocab_size": 12'))], ("config.json",)),
    Case("config.json hidden_act = gelu (changes the math)", "HF config.json", lambda t: _hf_config(t, hidden_act="gelu"), ("hidden_act",)),
    # --- model directories: tokenizer config, shards, index, template ---
    Case('tokenizer_config add_bos_token = "yes"', "model directory", lambda t: _model_dir(t, lambda d: _edit_json(d / "tokenizer_config.json", add_bos_token="yes")), ("tokenizer_config.json", "add_bos_token"), needs_model=True),
    Case("tokenizer_config not JSON", "model directory", lambda t: _model_dir(t, lambda d: write(d / "tokenizer_config.json", "{oops")), ("tokenizer_config.json",), needs_model=True),
    Case("truncated safetensors shard", "model directory", lambda t: _model_dir(t, _truncate), ("model.safetensors",), needs_model=True),
    Case("index points outside the directory", "model directory", lambda t: _model_dir(t, _index_outside), ("index.json", "outside"), needs_model=True),
    Case('generation_config eos_token_id = "2"', "model directory", lambda t: _model_dir(t, lambda d: write(d / "generation_config.json", '{"eos_token_id": "2"}')), ("generation_config.json", "eos_token_id"), needs_model=True),
    Case("chat template does not compile", "model directory", lambda t: _model_dir(t, lambda d: _edit_json(d / "tokenizer_config.json", chat_template="{% for %}"), "--chat",), ("chat template",), needs_model=True),
    Case("chat template raises", "model directory", lambda t: _model_dir(t, lambda d: _edit_json(d / "tokenizer_config.json", chat_template="{{ raise_exception('no system role') }}"), "--chat",), ("chat template", "no system role"), needs_model=True),
    Case("index weight_map entry = 5", "model directory", lambda t: _model_dir(t, lambda d: write(d / "model.safetensors.index.json", '{"weight_map": {"a": 5}}')), ("index.json", "weight_map"), needs_model=True),
    Case("export --out is the input directory", "model directory", lambda t: _export(str(tiny_hf(t)), t)[:-1] + [str(t / "tiny")], ("--out",), needs_model=True),
    # --- GGUF ---
    Case("GGUF with a bad magic", "GGUF", lambda t: _gguf(t, b"GGUX"), ("bad.gguf", "magic")),
    Case("GGUF truncated after the magic", "GGUF", lambda t: _gguf(t, b"GGUF" + struct.pack("<I", 3)), ("bad.gguf",)),
    # --- compression markers ---
    Case('quant marker version = "1"', "compression marker", lambda t: _marker(t, version="1"), ("llmopt_quant.json", "version")),
    Case("quant marker modules = []", "compression marker", lambda t: _marker(t, modules=[]), ("llmopt_quant.json", "modules")),
    Case("quant marker weights_sha256 = 5", "compression marker", lambda t: _marker(t, weights_sha256=5), ("llmopt_quant.json", "weights_sha256")),
    Case("quant marker not JSON", "compression marker", lambda t: _export(str(write(t / "q" / "llmopt_quant.json", "{").parent), t), ("llmopt_quant.json",)),
    # --- output paths, refused before any work ---
    Case("quantize --out under a file", "output paths", lambda t: ["quantize", "--out", str(write(t / "f", "x") / "out")], ("--out", "is a file")),
    Case("quantize --out is a file", "output paths", lambda t: ["quantize", "--out", str(write(t / "f", "x"))], ("--out", "is a file")),
    Case("export gguf --out is a directory", "output paths", lambda t: ["export", "--model", "x", "--format", "gguf", "--out", str(t)], ("--out", "directory")),
    Case("report --out under a file", "output paths", lambda t: ["report", str(t), "--out", str(write(t / "f", "x") / "r.html")], ("--out",)),
    Case("plan --emit under a file", "output paths", lambda t: ["plan", "--emit", str(write(t / "f", "x") / "run.toml")], ("--emit",)),
    Case("profile --out in an unwritable place", "output paths", lambda t: ["profile", "--out", "/proc/llmopt-probe/out"], ("--out",), local=False),
]
# fmt: on
