"""Code outside llmopt/models names no Llama module: it reads names from the ModelSpec.

Scanned with Python's tokenizer, so prose in comments never counts. A hit is
- an attribute access `.q_proj`, `.self_attn`, `.mlp`, `.lm_head`, `.layers`, ... (the names the
  working rules list); `.norm(` is a call (a tensor's norm) and does not count, `.norm` does;
- a string holding one of those names as a component of a dotted path (`"layers.0.mlp"`,
  `"lm_head.weight"`), or the block-module names on their own (`"q_proj"`).
Not hits: import lines (module paths such as `llmopt.models.layers`), CLI flags (`"--mlp"`, a
renamed flag) and the planner with its validation vocabulary (`llmopt/plan/`,
`llmopt/validate/software.py` never hold a model: their strings are frameworks' names, Megatron's
`--recompute-modules mlp`). Nothing else is allow-listed: a hit that is
legitimately something else gets renamed.
"""

from __future__ import annotations

import io
import re
import tokenize

from tests.paths import REPO

ROOT = REPO / "llmopt"
NAMES = {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "self_attn",
    "mlp",
    "input_layernorm",
    "post_attention_layernorm",
    "embed_tokens",
    "lm_head",
}
DOTTED_ONLY = {"layers", "norm"}  # common words: hits only inside a dotted path
_QUOTED = re.compile(r"[rRbBfFuU]*('''|\"\"\"|'|\")(.*)\1", re.S)
_STRING_TOKENS = {tokenize.STRING} | (
    {tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set()
)


def llama_names(source: str) -> list[tuple[int, str]]:
    """(line, offending text) for every hit in one module's source."""
    hits = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    importing = False  # inside an import statement: dotted names are module paths
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            importing = False
        elif (
            tok.type == tokenize.NAME
            and tok.string in ("import", "from")
            and (
                i == 0
                or tokens[i - 1].type
                in (
                    tokenize.NEWLINE,
                    tokenize.INDENT,
                    tokenize.DEDENT,
                    tokenize.NL,
                    tokenize.COMMENT,
                )
            )
        ):
            importing = True
        if importing:
            continue
        if tok.type == tokenize.NAME and i and tokens[i - 1].string == ".":
            called = i + 1 < len(tokens) and tokens[i + 1].string == "("
            if tok.string in NAMES or (
                tok.string in DOTTED_ONLY and not (tok.string == "norm" and called)
            ):
                hits.append((tok.start[0], "." + tok.string))
        elif tok.type in _STRING_TOKENS:
            quoted = _QUOTED.fullmatch(tok.string)
            content = quoted.group(2) if quoted else tok.string  # f-string parts are bare
            if content.rstrip(".") in DOTTED_ONLY and content.endswith("."):
                hits.append((tok.start[0], repr(content)))  # a prefix such as "layers."
                continue
            for word in re.findall(r"(?<!--)\b[A-Za-z_][\w.]*", tok.string):  # not --flags
                parts = word.strip(".").split(".")
                if any(p in NAMES or (p in DOTTED_ONLY and len(parts) > 1) for p in parts):
                    hits.append((tok.start[0], repr(word)))
    return hits


def test_the_scanner_finds_each_kind_of_hit():
    source = (
        "a = model.lm_head(x)\n"
        "b = block.mlp.kind\n"
        "c = t.norm()\n"  # a tensor method: not a hit
        "d = model.norm\n"
        'e = name.startswith("layers.")\n'
        'f = f"layers.{i}.self_attn"\n'
        'g = ("q_proj", "the layers and the norm")\n'  # prose words are not hits
        "# model.lm_head in a comment is prose\n"
        "h = spec.head\n"
        "from llmopt.models.layers import rms_norm\n"  # a module path: not a hit
        'i = {"--mlp": "--activation"}\n'  # a CLI flag: not a hit
        "j = x.layers\n"
    )
    assert [line for line, _ in llama_names(source)] == [1, 2, 4, 5, 6, 7, 12]


def test_no_llama_attribute_names_outside_llmopt_models():
    hits = [
        f"{path.relative_to(ROOT.parent)}:{line}: {text}"
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).parts[0] not in ("models", "plan")
        and path.relative_to(ROOT).as_posix() != "validate/software.py"
        for line, text in llama_names(path.read_text())
    ]
    assert not hits, "read module names from llmopt.models.spec.spec_for(model):\n" + "\n".join(
        hits
    )
