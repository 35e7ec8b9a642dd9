"""The bad and edge-case inputs of the reliability sweep, one line each.

Each case builds its files in a scratch directory (`builders`) and returns the argv for
`llmopt`; `names` are the strings its one-line error must contain (the flag, the file, the
key), so an error that only says "num_attention_heads" counts as vague, not clean. `named`
marks the cases issue 30 listed (CI's quick tier always runs those that build no model).
`changes`: file names a case may change (what `--overwrite` is asked to replace). One line
per case keeps the catalogue readable as a table; hence its length.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.validate.reliability import builders as b
from llmopt.validate.reliability.builders import Build


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # the fault / bad-input class the docs count
    build: Build
    names: tuple[str, ...] = ()  # what the error line must mention
    expect: int = 2  # exit status of a clean refusal (0: the command must succeed)
    needs_model: bool = False  # builds a model, an adapter or a run (slower)
    local: bool = True  # touches only its scratch directory (the tests run only these)
    named: bool = False  # named by issue 30
    changes: tuple[str, ...] = ()  # file names the case is allowed to change


_TRAIN_SMALL = "num_layers = 1\nhidden_size = 16\n"
_TP3 = "corpus = 'random'\nnum_layers = 1\nhidden_size = 16\nnum_heads = 2\nnum_kv_heads = 1\nseq_len = 16\nglobal_batch = 3\nmicro_batch = 1\n[parallel]\ntp = 3\n"  # fmt: skip
_FUSE = '[[stage]]\nkind = "fuse"\n'
_MOE = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2, "num_key_value_heads": 0}  # fmt: skip
_PLAN_RENAMES = [("--layers", "--num-layers"), ("--hidden", "--hidden-size"), ("--heads", "--num-heads"), ("--kv-heads", "--num-kv-heads"), ("--ffn", "--intermediate-size"), ("--vocab", "--vocab-size"), ("--sp", "--sequence-parallel")]  # fmt: skip


def _out(command: list[str], out: str = "mine") -> Build:
    """`command --out DIR` where DIR holds the user's own files."""
    return lambda t: [*command, "--out", str(b.user_dir(t / out))]


def _model_out(command: list[str], *extra: str) -> Build:
    """A real tiny model into an --out holding the user's files."""
    return lambda t: [*command, "--model", str(b.tiny_hf(t)), "--out", str(b.user_dir(t / "mine")), *extra]  # fmt: skip


# fmt: off
CASES: list[Case] = [
    # --- numeric flags whose falsy or non-finite value used to be reinterpreted ---
    Case("plan estimate --tp 0", "numeric flags", b.one("estimate", "--tp", "0"), ("--tp",)),
    Case("plan --nodes 0", "numeric flags", b.one("plan", "--nodes", "0"), ("--nodes",)),
    Case("plan --seq-len -1", "numeric flags", b.one("plan", "--seq-len", "-1"), ("seq_len",)),
    Case("generate --threads 0", "numeric flags", b.one("generate", "--threads", "0"), ("--threads",)),
    Case("generate --top-p 0", "numeric flags", b.one("generate", "--top-p", "0"), ("--top-p",)),
    Case("generate --temperature nan", "numeric flags", b.one("generate", "--temperature", "nan"), ("--temp",)),
    Case("generate --max-new-tokens -1", "numeric flags", b.one("generate", "--max-new-tokens", "-1"), ("--max",)),
    Case("generate --gamma 0", "numeric flags", lambda t: b.gen("x", "--draft", "ngram", "--gamma", "0"), ("--gamma",)),
    Case("eval ppl --stride 0", "numeric flags", b.one("eval", "--stride", "0"), ("--stride",)),
    Case("eval ppl --ctx 0", "numeric flags", b.one("eval", "--ctx", "0"), ("--ctx",)),
    Case("serve --port 70000", "numeric flags", b.one("serve", "--port", "70000"), ("--port",)),
    Case("serve --max-num-seqs 0", "numeric flags", b.one("serve", "--max-num-seqs", "0"), ("--max-num-seqs",)),
    Case("serve --drain-timeout inf", "numeric flags", b.one("serve", "--drain-timeout", "inf"), ("--drain",)),
    Case("profile --new-tokens 0", "numeric flags", b.one("profile", "--new-tokens", "0"), ("--new-tokens",)),
    Case("plan --peak-tflops nan", "numeric flags", b.one("plan", "--peak-tflops", "nan"), ("peak",)),
    Case("plan --hbm-gib -80", "numeric flags", b.one("plan", "--hbm-gib", "-80"), ("hbm",)),
    Case("plan --global-batch 0", "numeric flags", b.one("plan", "--global-batch", "0"), ("global_batch",)),
    Case("plan --num-layers 99999999999999999999", "numeric flags", b.one("plan", "--num-layers", "99999999999999999999"), ("--num-layers",), named=True),
    Case("plan serve --tp 0", "numeric flags", b.one("plan serve", "--tp", "0"), ("--tp",), named=True),
    Case("train --steps -1", "numeric flags", b.one("train", "--steps", "-1"), ("steps",)),
    Case("train --lr nan", "numeric flags", b.one("train", "--lr", "nan"), ("lr",)),
    Case("train --nnodes abc", "numeric flags", b.one("train", "--nnodes", "abc"), ("--nnodes", "abc"), named=True),
    Case("train --nnodes 4:2", "numeric flags", b.one("train", "--nnodes", "4:2"), ("--nnodes",)),
    # --- resource limits, checked against the model and the memory before any work ---
    Case("serve --kv-blocks 100000000", "resource limits", b.one("serve", "--kv-blocks", "100000000"), ("--kv-blocks", "available"), named=True),
    Case("serve --block-size 100000", "resource limits", b.one("serve", "--block-size", "100000"), ("--block-size",), named=True),
    Case("serve --block-size beyond the model context", "resource limits", lambda t: ["serve", "--model", str(b.tiny_hf(t)), "--block-size", "128"], ("--block-size", "context"), needs_model=True),
    Case("profile --device tpu", "resource limits", b.one("profile", "--device", "tpu"), ("--device", "tpu"), named=True),
    Case("profile --device cuda:x", "resource limits", b.one("profile", "--device", "cuda:x"), ("--device",)),
    Case("bench serve against a closed port", "resource limits", lambda t: ["bench", "serve", "--url", "http://127.0.0.1:9", "--requests", "1", "--out", str(t / "b.json")], ("--url", "127.0.0.1:9"), named=True),
    Case("train tp=3 with a 2-head model", "resource limits", lambda t: ["train", "--config", str(b.write(t / "run.toml", _TP3)), "--nproc-per-node", "3", "--steps", "1", "--out-dir", str(t / "run")], ("run.toml", "tp=3", "num_heads"), named=True),
    # --- empty strings, abbreviations and renamed flags ---
    Case("generate --draft ''", "flag names", b.one("generate", "--draft", ""), ("--draft",)),
    Case("generate --model ''", "flag names", b.one("generate", "--model", ""), ("--model",)),
    Case("plan --gpus 8 (abbreviation)", "flag names", b.one("plan", "--gpus", "8"), ("8",)),
    Case("train --zero 1 (old name)", "flag names", b.one("train", "--zero", "1"), ("--zero-stage",), named=True),
    Case("train --microbatches 2 (old name)", "flag names", b.one("train", "--microbatches", "2"), ("--num-microbatches",), named=True),
    *[Case(f"plan {old} 4 (old name)", "flag names", b.one("plan", old, "4"), (old, new), named=True) for old, new in _PLAN_RENAMES],
    Case("plan --mlp gelu (old name)", "flag names", b.one("plan", "--mlp", "gelu"), ("--mlp", "--activation"), named=True),
    Case("plan estimate --zero 1 (old name)", "flag names", b.one("estimate", "--zero", "1"), ("--zero", "--zero-stage"), named=True),
    Case("plan estimate --microbatches 2 (old name)", "flag names", b.one("estimate", "--microbatches", "2"), ("--num-microbatches",), named=True),
    Case("serve --max-batched-tokens 8 (vLLM's name)", "flag names", b.one("serve", "--max-batched-tokens", "8"), ("--max-num-batched-tokens",)),
    Case("serve --no-prefix-caching (vLLM's name)", "flag names", b.one("serve", "--no-prefix-caching"), ("--no-enable-prefix-caching",)),
    Case("export --dtype int8 (one dtype vocabulary)", "flag names", b.one("export", "--dtype", "int8"), ("int8", "float16")),
    Case("serve --dtype fp8 (one dtype vocabulary)", "flag names", b.one("serve", "--dtype", "fp8"), ("fp8", "bfloat16")),
    Case("quantize --gguf-type with --format gptq", "flag names", lambda t: ["quantize", "--format", "gptq", "--gguf-type", "q8_0", "--out", str(t / "q")], ("--gguf-type", "--format gguf"), named=True),
    Case("plan --why-not ''", "flag names", b.one("plan", "--why-not", ""), ("--why-not",), named=True),
    Case("plan --why-not tp=8,tp=4", "flag names", b.one("plan", "--why-not", "tp=8,tp=4"), ("--why-not", "tp"), named=True),
    # --- text that is not UTF-8 ---
    Case("generate --prompt <0xff byte>", "non-UTF-8 text", lambda t: ["generate", "--prompt", "a\udcffb"], ("--prompt",)),
    Case("eval --text latin-1 file", "non-UTF-8 text", lambda t: ["eval", "ppl", "--text", str(b.write(t / "latin1.txt", b"caf\xe9 " * 50))], ("latin1.txt",)),
    Case("cluster TOML in UTF-16", "non-UTF-8 text", lambda t: b.cluster(t, "nodes = 2\n".encode("utf-16")), ("cluster.toml",)),
    # --- cluster TOML ---
    Case('cluster nodes = "eight"', "cluster TOML", lambda t: b.cluster(t, 'nodes = "eight"\n'), ("cluster.toml", "nodes")),
    Case("cluster nodes = true", "cluster TOML", lambda t: b.cluster(t, "nodes = true\n"), ("cluster.toml", "nodes")),
    Case("cluster nodes = 0", "cluster TOML", lambda t: b.cluster(t, "nodes = 0\n"), ("cluster.toml", "nodes")),
    Case('cluster [gpu] hbm_gib = "80"', "cluster TOML", lambda t: b.cluster(t, '[gpu]\nhbm_gib = "80"\n'), ("cluster.toml", "hbm_gib")),
    Case("cluster [gpu] hbm_gib = nan", "cluster TOML", lambda t: b.cluster(t, "[gpu]\nhbm_gib = nan\n"), ("cluster.toml", "hbm_gib")),
    Case("cluster unknown key", "cluster TOML", lambda t: b.cluster(t, "nodez = 2\n"), ("cluster.toml", "nodez")),
    Case("cluster gpu = 3 (not a table)", "cluster TOML", lambda t: b.cluster(t, "gpu = 3\n"), ("cluster.toml", "gpu")),
    Case("cluster invalid TOML", "cluster TOML", lambda t: b.cluster(t, "nodes = = 2\n"), ("cluster.toml",)),
    Case("cluster file missing", "cluster TOML", lambda t: ["plan", "--cluster", str(t / "none.toml")], ("none.toml",)),
    Case("cluster TOML empty", "cluster TOML", lambda t: b.cluster(t, ""), ("cluster.toml",), named=True),
    # --- training config TOML ---
    Case('train steps = "5"', "training config", lambda t: b.train_config(t, 'steps = "5"\n'), ("run.toml", "steps")),
    Case("train zero_stage = true", "training config", lambda t: b.train_config(t, "zero_stage = true\n"), ("run.toml", "zero_stage")),
    Case("train zero = true (old key)", "training config", lambda t: b.train_config(t, "zero = true\n"), ("run.toml", "zero_stage")),
    Case("train lr = inf", "training config", lambda t: b.train_config(t, "lr = inf\n"), ("run.toml", "lr")),
    Case("train [parallel] tp = 1.5", "training config", lambda t: b.train_config(t, "[parallel]\ntp = 1.5\n"), ("run.toml", "tp")),
    Case("train unknown key", "training config", lambda t: b.train_config(t, _TRAIN_SMALL + "stepz = 3\n"), ("run.toml", "stepz")),
    Case("train JSON config with NaN", "training config", lambda t: ["train", "--config", str(b.write(t / "run.json", '{"lr": NaN}'))], ("run.json",)),
    Case("train --init-from a quantized directory", "training config", lambda t: ["train", "--init-from", str(b.quantized(t)), "--steps", "1", "--corpus", "random", "--seq-len", "16", "--global-batch", "1", "--micro-batch", "1", "--out-dir", str(t / "run")], ("--init-from", "QuantLinear"), needs_model=True, named=True),
    Case("train --resume at the finished step", "training config", b.finished_run, ("nothing to do", "--steps"), needs_model=True, named=True),
    Case("distill --resume at the finished step", "training config", b.finished_distill, ("nothing to do", "--steps"), needs_model=True, named=True),
    # --- fine-tuning (chat) data: the error names the line and the field ---
    Case("chat data: a line that is not JSON", "chat data", lambda t: b.chat_data(t, b.GOOD_CHAT, "{oops"), ("chat.jsonl:2",), needs_model=True, named=True),
    Case("chat data: a line that is a list", "chat data", lambda t: b.chat_data(t, b.GOOD_CHAT, "[1, 2]"), ("chat.jsonl:2", "list"), needs_model=True, named=True),
    Case("chat data: messages is a string", "chat data", lambda t: b.chat_data(t, b.GOOD_CHAT, '{"messages": "hi"}'), ("chat.jsonl:2", "messages"), needs_model=True, named=True),
    Case("chat data: a message without content", "chat data", lambda t: b.chat_data(t, b.GOOD_CHAT, '{"messages": [{"role": "user"}]}'), ("chat.jsonl:2", "messages[0]", "content"), needs_model=True, named=True),
    Case("chat data: content is a number", "chat data", lambda t: b.chat_data(t, '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}'), ("chat.jsonl:1", "messages[0].content"), needs_model=True, named=True),
    Case("chat data: an unknown role", "chat data", lambda t: b.chat_data(t, '{"messages": [{"role": "robot", "content": "x"}]}'), ("chat.jsonl:1", "role", "robot"), needs_model=True, named=True),
    Case("chat data: no assistant turn", "chat data", lambda t: b.chat_data(t, b.GOOD_CHAT, '{"messages": [{"role": "user", "content": "x"}]}'), ("chat.jsonl:2", "assistant"), needs_model=True, named=True),
    Case("chat data: prompt is a number", "chat data", lambda t: b.chat_data(t, '{"prompt": 1, "completion": "x"}'), ("chat.jsonl:1", "prompt"), needs_model=True, named=True),
    # --- HF config.json ---
    Case("config.json lacks num_attention_heads", "HF config.json", lambda t: b.hf_config(t, num_attention_heads=...), ("config.json", "num_attention_heads")),
    Case('config.json hidden_size = "64"', "HF config.json", lambda t: b.hf_config(t, hidden_size="64"), ("config.json", "hidden_size")),
    Case("config.json num_hidden_layers = true", "HF config.json", lambda t: b.hf_config(t, num_hidden_layers=True), ("config.json", "num_hidden_layers")),
    Case('config.json rms_norm_eps = "1e-5"', "HF config.json", lambda t: b.hf_config(t, rms_norm_eps="1e-5"), ("config.json", "rms_norm_eps")),
    Case("config.json is a list", "HF config.json", lambda t: ["plan", "--model", str(b.write(t / "c" / "config.json", "[1, 2]"))], ("config.json",)),
    Case("config.json truncated", "HF config.json", lambda t: ["plan", "--model", str(b.write(t / "c" / "config.json", '{"vocab_size": 12'))], ("config.json",)),
    Case("config.json hidden_act = gelu (changes the math)", "HF config.json", lambda t: b.hf_config(t, hidden_act="gelu"), ("hidden_act",)),
    Case("config.json MoE with zero KV heads", "HF config.json", lambda t: b.hf_config(t, **_MOE), ("config.json", "num_key_value_heads"), named=True),
    # --- model directories: tokenizer config, shards, index, template ---
    Case('tokenizer_config add_bos_token = "yes"', "model directory", lambda t: b.model_dir(t, lambda d: b.edit_json(d / "tokenizer_config.json", add_bos_token="yes")), ("tokenizer_config.json", "add_bos_token"), needs_model=True),
    Case("tokenizer_config not JSON", "model directory", lambda t: b.model_dir(t, lambda d: b.write(d / "tokenizer_config.json", "{oops")), ("tokenizer_config.json",), needs_model=True),
    Case("tokenizer_config eos_token is not a token", "model directory", lambda t: b.model_dir(t, lambda d: b.edit_json(d / "tokenizer_config.json", eos_token="<|no such token|>")), ("tokenizer_config.json", "eos_token"), needs_model=True, named=True),
    Case("truncated safetensors shard", "model directory", lambda t: b.model_dir(t, b.truncate), ("model.safetensors",), needs_model=True),
    Case("safetensors with integer dtypes (generate)", "model directory", lambda t: b.model_dir(t, b.integer_weights), ("int32", "floating point"), needs_model=True, named=True),
    Case("safetensors with integer dtypes (eval ppl)", "model directory", b.integer_weights_eval, ("int32", "floating point"), needs_model=True, named=True),
    Case("index points outside the directory", "model directory", lambda t: b.model_dir(t, b.index_outside), ("index.json", "outside"), needs_model=True),
    Case('generation_config eos_token_id = "2"', "model directory", lambda t: b.model_dir(t, lambda d: b.write(d / "generation_config.json", '{"eos_token_id": "2"}')), ("generation_config.json", "eos_token_id"), needs_model=True),
    Case("chat template does not compile", "model directory", lambda t: b.model_dir(t, lambda d: b.edit_json(d / "tokenizer_config.json", chat_template="{% for %}"), "--chat"), ("chat template",), needs_model=True),
    Case("chat template raises", "model directory", lambda t: b.model_dir(t, lambda d: b.edit_json(d / "tokenizer_config.json", chat_template="{{ raise_exception('no system role') }}"), "--chat"), ("chat template", "no system role"), needs_model=True),
    Case("index weight_map entry = 5", "model directory", lambda t: b.model_dir(t, lambda d: b.write(d / "model.safetensors.index.json", '{"weight_map": {"a": 5}}')), ("index.json", "weight_map"), needs_model=True),
    Case("export --out is the input directory", "model directory", lambda t: b.export(str(b.tiny_hf(t)), t)[:-1] + [str(t / "tiny")], ("--out",), needs_model=True),
    # --- GGUF ---
    Case("GGUF with a bad magic", "GGUF", lambda t: b.gguf(t, b"GGUX"), ("bad.gguf", "magic")),
    Case("GGUF truncated after the magic", "GGUF", lambda t: b.gguf(t, b"GGUF" + (3).to_bytes(4, "little")), ("bad.gguf",)),
    # --- compression markers ---
    Case('quant marker version = "1"', "compression marker", lambda t: b.marker(t, version="1"), ("llmopt_quant.json", "version")),
    Case("quant marker modules = []", "compression marker", lambda t: b.marker(t, modules=[]), ("llmopt_quant.json", "modules")),
    Case("quant marker weights_sha256 = 5", "compression marker", lambda t: b.marker(t, weights_sha256=5), ("llmopt_quant.json", "weights_sha256")),
    Case("quant marker not JSON", "compression marker", lambda t: b.export(str(b.write(t / "q" / "llmopt_quant.json", "{").parent), t), ("llmopt_quant.json",)),
    Case('quant marker in_features = "16"', "compression marker", lambda t: b.edit_module_entry(t, in_features="16"), ("llmopt_quant.json", "in_features"), needs_model=True, named=True),
    Case('quant marker bits = "4"', "compression marker", lambda t: b.edit_module_entry(t, bits="4"), ("llmopt_quant.json", "bits"), needs_model=True, named=True),
    Case('quant marker bias = "no"', "compression marker", lambda t: b.edit_module_entry(t, bias="no"), ("llmopt_quant.json", "bias"), needs_model=True),
    # --- recipes ---
    Case("recipe stage given as a table", "compress recipe", lambda t: b.recipe(t, 'stage = {kind = "prune"}\n'), ("recipe.toml", "[[stage]]"), named=True),
    Case("recipe eval given as a scalar", "compress recipe", lambda t: b.recipe(t, 'eval = "corpus:web-bible"\n' + _FUSE), ("recipe.toml", "eval"), named=True),
    Case("recipe [eval] max_tokens a string", "compress recipe", lambda t: b.recipe(t, '[eval]\nmax_tokens = "many"\n' + _FUSE), ("recipe.toml", "max_tokens")),
    Case("recipe stage bits a string", "compress recipe", lambda t: b.recipe(t, '[[stage]]\nkind = "quantize"\nbits = "4"\n'), ("recipe.toml", "bits")),
    Case("recipe stage kind unknown", "compress recipe", lambda t: b.recipe(t, '[[stage]]\nkind = "shrink"\n'), ("kind", "shrink")),
    # --- merge ---
    Case("merge --base a quantized directory", "merge", lambda t: ["merge", "--base", str(b.quantized(t)), "--adapter", str(b.adapter(t, t / "base")), "--out", str(t / "m")], ("--base", "QuantLinear"), needs_model=True, named=True),
    Case("merge onto another base of the same shape", "merge", b.merge_onto_other_base, ("--base", "another base"), needs_model=True, named=True),
    # --- output paths and directories: refused before any work, nothing of the user's lost ---
    Case("quantize --out under a file", "output paths", lambda t: ["quantize", "--out", str(b.write(t / "f", "x") / "out")], ("--out", "is a file")),
    Case("quantize --out is a file", "output paths", lambda t: ["quantize", "--out", str(b.write(t / "f", "x"))], ("--out", "is a file")),
    Case("export gguf --out is a directory", "output paths", lambda t: ["export", "--model", "x", "--format", "gguf", "--out", str(t)], ("--out", "directory")),
    Case("report --out under a file", "output paths", lambda t: ["report", str(t), "--out", str(b.write(t / "f", "x") / "r.html")], ("--out",)),
    Case("plan --emit under a file", "output paths", lambda t: ["plan", "--emit", str(b.write(t / "f", "x") / "run.toml")], ("--emit",)),
    Case("profile --out in an unwritable place", "output paths", lambda t: ["profile", "--out", "/proc/llmopt-probe/out"], ("--out",), local=False),
    Case("export hf into the user's directory", "output directories", _model_out(["export", "--format", "hf"]), ("--out", "mine", "--overwrite"), needs_model=True, named=True),
    Case("export onnx into the user's directory", "output directories", _model_out(["export", "--format", "onnx"]), ("--out", "mine", "--overwrite"), needs_model=True, named=True),
    Case("export gguf onto the user's file", "output directories", lambda t: ["export", "--model", "x", "--format", "gguf", "--out", str(b.write(t / "notes.gguf", "my notes"))], ("--out", "not a GGUF", "--overwrite")),
    *[Case(f"quantize --format {fmt} into the user's directory", "output directories", _model_out(["quantize", "--method", "rtn", "--group-size", "-1", "--format", fmt]), ("--out", "mine", "--overwrite"), needs_model=True, named=True) for fmt in ("gptq", "compressed-tensors", "autoawq", "llmopt")],
    Case("prune into the user's directory", "output directories", _model_out(["prune", "--method", "magnitude"]), ("--out", "mine", "--overwrite"), needs_model=True),
    Case("distill into the user's directory", "output directories", _out(["distill", "--teacher", "smollm2-135m", "--student", "init:teacher-layers=0"]), ("mine", "--overwrite")),
    Case("compress --recipe into the user's directory", "output directories", lambda t: b.recipe(t, _FUSE, "--out", str(b.user_dir(t / "mine"))), ("mine", "--overwrite")),
    Case("profile into the user's directory", "output directories", _out(["profile"]), ("--out", "mine", "--overwrite")),
    Case("train --out-dir the user's directory", "output directories", lambda t: ["train", "--out-dir", str(b.user_dir(t / "mine")), "--steps", "1"], ("mine", "--overwrite")),
    Case("merge --out the user's directory", "output directories", lambda t: ["merge", "--base", "x", "--adapter", str(t / "none"), "--out", str(b.user_dir(t / "mine"))], ("--out", "mine", "--overwrite")),
    Case("export hf --overwrite keeps the user's other files", "output directories", _model_out(["export", "--format", "hf"], "--overwrite"), expect=0, needs_model=True, changes=("config.json",)),
    Case("quantize gptq --overwrite keeps the user's other files", "output directories", _model_out(["quantize", "--method", "rtn", "--group-size", "-1", "--format", "gptq", "--json"], "--overwrite"), expect=0, needs_model=True, changes=("config.json",)),
    Case("merge beside an OUT.partial it did not create", "output directories", b.merge_beside_partial, expect=0, needs_model=True, named=True),
]
# fmt: on
