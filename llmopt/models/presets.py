"""Architecture presets with the published shapes (from each model's released config.json).

A preset is only a `ModelConfig`: building one allocates nothing, so the planner can use
Llama-3.1-405B as freely as SmolLM2-135M.
"""

from __future__ import annotations

from llmopt.errors import LlmoptError
from llmopt.models.config import ModelConfig
from llmopt.models.moe import MLAConfig, MoEConfig

_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _smollm2(name: str, hidden: int, ffn: int, layers: int, heads: int, kv: int, theta: float):
    return ModelConfig(
        name=name,
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        max_seq_len=8192,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def _llama(name, hidden, ffn, layers, heads, kv, vocab, theta, ctx, eps=1e-5, scaling=None):
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        max_seq_len=ctx,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=eps,
        tie_embeddings=False,
    )


def _qwen25(name, hidden, ffn, layers, heads, kv, vocab, tied):
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        max_seq_len=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=tied,
        attention_bias=True,
        eos_token_id=151643,
        architecture="qwen2",
    )


def _moe(name, hidden, ffn, layers, heads, kv, vocab, ctx, moe, head_dim=None, mla=None, arch="llama"):  # fmt: skip
    """A MoE shape; the model builds it where `arch` has a MoE block (the planner reads any)."""
    return ModelConfig(
        architecture=arch,
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        max_seq_len=ctx,
        head_dim=head_dim,
        moe=moe,
        mla=mla,
    )


# From each model's released config.json: Mixtral-8x7B/8x22B-v0.1, DeepSeek-V3, Qwen3-30B-A3B,
# Qwen3-235B-A22B, gpt-oss-120b.
MOE_PRESETS = [
    _moe(
        "mixtral-8x7b", 4096, 14336, 32, 32, 8, 32000, 32768, MoEConfig(8, 2, 14336), arch="mixtral"
    ),
    _moe(
        "mixtral-8x22b",
        6144,
        16384,
        56,
        48,
        8,
        32768,
        65536,
        MoEConfig(8, 2, 16384),
        arch="mixtral",
    ),
    _moe(
        "deepseek-v3",
        7168,
        18432,
        61,
        128,
        128,
        129280,
        163840,
        MoEConfig(256, 8, 2048, moe_layers=58, shared_experts=1, mtp_layers=1),
        mla=MLAConfig(512, 128, 64, 128, q_lora_rank=1536),
    ),  # fmt: skip
    _moe(
        "qwen3-30b-a3b",
        2048,
        6144,
        48,
        32,
        4,
        151936,
        40960,
        MoEConfig(128, 8, 768),
        128,
        arch="qwen3_moe",
    ),
    _moe(
        "qwen3-235b-a22b",
        4096,
        12288,
        94,
        64,
        4,
        151936,
        40960,
        MoEConfig(128, 8, 1536),
        128,
        arch="qwen3_moe",
    ),
    _moe("gpt-oss-120b", 2880, 2880, 36, 64, 8, 201088, 131072, MoEConfig(128, 4, 2880), 64),
]


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        _smollm2("smollm2-135m", 576, 1536, 30, 9, 3, 100000.0),
        _smollm2("smollm2-360m", 960, 2560, 32, 15, 5, 100000.0),
        _smollm2("smollm2-1.7b", 2048, 8192, 24, 32, 32, 130000.0),
        _llama("llama-2-7b", 4096, 11008, 32, 32, 32, 32000, 10000.0, 4096),
        _llama("llama-2-13b", 5120, 13824, 40, 40, 40, 32000, 10000.0, 4096),
        _llama("llama-2-70b", 8192, 28672, 80, 64, 8, 32000, 10000.0, 4096),
        _llama("llama-3-8b", 4096, 14336, 32, 32, 8, 128256, 500000.0, 8192),
        _llama("llama-3-70b", 8192, 28672, 80, 64, 8, 128256, 500000.0, 8192),
        _llama(
            "llama-3.1-8b",
            4096,
            14336,
            32,
            32,
            8,
            128256,
            500000.0,
            131072,
            scaling=_LLAMA3_ROPE_SCALING,
        ),
        _llama(
            "llama-3.1-70b",
            8192,
            28672,
            80,
            64,
            8,
            128256,
            500000.0,
            131072,
            scaling=_LLAMA3_ROPE_SCALING,
        ),
        _llama(
            "llama-3.1-405b",
            16384,
            53248,
            126,
            128,
            8,
            128256,
            500000.0,
            131072,
            scaling=_LLAMA3_ROPE_SCALING,
        ),
        _qwen25("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, tied=True),
        _qwen25("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 151936, tied=True),
        _qwen25("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, tied=False),
        # GPT-3 175B shapes (Brown et al. 2020) with Megatron's padded vocabulary, as used in
        # the published Megatron runs the planner is validated against; GELU MLP, tied head.
        ModelConfig(
            name="gpt3-175b",
            vocab_size=51200,
            hidden_size=12288,
            intermediate_size=49152,
            num_layers=96,
            num_heads=96,
            num_kv_heads=96,
            max_seq_len=2048,
            tie_embeddings=True,
            mlp="gelu",
        ),
        *MOE_PRESETS,
    ]
}

ALIASES = {
    "smollm2": "smollm2-135m",
    "llama2-7b": "llama-2-7b",
    "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
    "llama3.1-405b": "llama-3.1-405b",
    "gpt-3-175b": "gpt3-175b",
    "deepseekv3": "deepseek-v3",
    "gpt-oss": "gpt-oss-120b",
    "qwen3_30b_a3b": "qwen3-30b-a3b",
    "qwen3_235b_a22b": "qwen3-235b-a22b",
}


class UnknownPresetError(LlmoptError, KeyError):
    """A preset name that is not in the catalogue (a KeyError for the lookups that catch one)."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else ""


def get_preset(name: str) -> ModelConfig:
    """Look up a preset by (case-insensitive) name or alias."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise UnknownPresetError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[key]
