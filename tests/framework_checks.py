"""What the frameworks accept, for the emitter tests: Megatron-LM's option names and choices,
Megatron-Core's own TransformerConfig validation of an emitted line, torchtitan's JobConfig
fields, and a script that runs DeepSpeed's own config classes and launcher parser."""

from __future__ import annotations

# Megatron-LM option strings and choices, from the argparse parser that
# megatron/training/arguments.py builds (NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553,
# flags generated from TransformerConfig/ModelParallelConfig included): only those used here.
MEGATRON_FLAGS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
    "--group-query-attention", "--num-query-groups", "--kv-channels", "--seq-length",
    "--max-position-embeddings", "--position-embedding-type", "--rotary-base", "--normalization",
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--tokenizer-type", "--vocab-size", "--mock-data", "--micro-batch-size",
    "--global-batch-size", "--train-iters", "--lr", "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
    "--context-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--bf16",
    "--fp8-format", "--fp8-recipe", "--grad-reduce-in-bf16", "--pipeline-model-parallel-layout",
    "--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather",
    # MoE / MLA / MTP (--num-experts, --moe-layer-freq and the MLA ranks are arguments.py's own;
    # the rest are TransformerConfig / ModelParallelConfig fields its ArgumentGroupFactory adds)
    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--mtp-num-layers",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--moe-grouped-gemm",
    "--moe-router-load-balancing-type", "--moe-token-dispatcher-type",
    "--moe-flex-dispatcher-backend", "--overlap-moe-expert-parallel-comm",
    "--multi-latent-attention", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
    "--v-head-dim", "--q-lora-rank",
}  # fmt: skip
MEGATRON_CHOICES = {
    "--position-embedding-type": {"learned_absolute", "rope", "yarn", "mrope", "relative", "none"},
    "--normalization": {"LayerNorm", "RMSNorm"},
    "--recompute-granularity": {"full", "selective"},
    "--recompute-method": {"uniform", "block"},
    "--fp8-format": {"e4m3", "hybrid"},
    "--fp8-recipe": {"tensorwise", "delayed", "mxfp8", "blockwise", "custom"},
    "--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},
    "--ckpt-format": {"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"},
    "--tokenizer-type": {"NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"},
    "--moe-token-dispatcher-type": {"allgather", "alltoall", "flex"},
    "--moe-flex-dispatcher-backend": {"deepep", "hybridep", "ncclep"},
    "--moe-router-load-balancing-type": {"aux_loss", "seq_aux_loss", "global_aux_loss",
                                         "sinkhorn", "none"},
}  # fmt: skip

# torchtitan JobConfig sections and fields (torchtitan/config/job_config.py at
# pytorch/torchtitan@238fa9953e4aec2a62582121564273d7cbb1e9f1): only those used here, with the
# Literal values they allow.
TORCHTITAN_FIELDS = {
    "job": {"description"},
    "model": {"name", "flavor", "converters"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param",
                 "mixed_precision_reduce"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree",
                    "fsdp_reshard_after_forward", "tensor_parallel_degree",
                    "pipeline_parallel_degree", "context_parallel_degree",
                    "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "quantize": {"linear"},
}  # fmt: skip
TORCHTITAN_LITERALS = {
    ("parallelism", "fsdp_reshard_after_forward"): {"default", "always", "never"},
    ("activation_checkpoint", "mode"): {"selective", "full", "memory_budget", "none"},
    ("training", "mixed_precision_param"): {"bfloat16", "float32"},
    ("training", "mixed_precision_reduce"): {"float32"},
}


DS_CHECK = r"""
import json, sys
import deepspeed.runtime.config as dsc
from deepspeed.runtime import constants
from deepspeed.launcher.runner import parse_args

dsc.dist.get_rank = lambda *a, **k: 0  # no process group: DeepSpeedConfig only asks the rank
known = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
known |= {"zero_optimization", "tensor_parallel", "activation_checkpointing"}


class MPU:  # the data-parallel size is what DeepSpeed checks the batch against
    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


for path, dp, launcher in json.loads(sys.argv[1]):
    cfg = json.load(open(path))
    unknown = set(cfg) - known
    assert not unknown, unknown
    c = dsc.DeepSpeedConfig(cfg, mpu=MPU(dp))
    args = parse_args(launcher.split()[1:])
    print(json.dumps({"batch": c.train_batch_size, "gas": c.gradient_accumulation_steps,
                      "zero": c.zero_optimization_stage, "tp": c.tensor_parallel_config.autotp_size,
                      "nodes": args.num_nodes, "gpus": args.num_gpus, "script": args.user_script}))
"""


# ---- Megatron-Core's own validation of what we emit (issue 27) ----
# The emitted pretrain_gpt.py flags map 1:1 onto Megatron-Core TransformerConfig fields (the
# names megatron/training/arguments.py gives them); building the config runs Megatron-Core's
# own __post_init__ checks (pipeline layout, uneven splits, MoE, MLA, MTP, A2A overlap rules).
# Transformer Engine needs a GPU build, so its version checks answer as TE 2.9 would.
MCORE_INT = {
    "--num-layers": "num_layers", "--hidden-size": "hidden_size",
    "--ffn-hidden-size": "ffn_hidden_size", "--num-attention-heads": "num_attention_heads",
    "--num-query-groups": "num_query_groups", "--kv-channels": "kv_channels",
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--context-parallel-size": "context_parallel_size",
    "--expert-model-parallel-size": "expert_model_parallel_size",
    "--expert-tensor-parallel-size": "expert_tensor_parallel_size",
    "--num-experts": "num_moe_experts", "--moe-router-topk": "moe_router_topk",
    "--moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "--moe-shared-expert-intermediate-size": "moe_shared_expert_intermediate_size",
    "--mtp-num-layers": "mtp_num_layers", "--recompute-num-layers": "recompute_num_layers",
    "--q-lora-rank": "q_lora_rank", "--kv-lora-rank": "kv_lora_rank",
    "--qk-head-dim": "qk_head_dim", "--qk-pos-emb-head-dim": "qk_pos_emb_head_dim",
    "--v-head-dim": "v_head_dim",
}  # fmt: skip
MCORE_STR = {
    "--pipeline-model-parallel-layout": "pipeline_model_parallel_layout",
    "--moe-token-dispatcher-type": "moe_token_dispatcher_type",
    "--moe-flex-dispatcher-backend": "moe_flex_dispatcher_backend",
    "--moe-router-load-balancing-type": "moe_router_load_balancing_type",
    "--recompute-granularity": "recompute_granularity", "--recompute-method": "recompute_method",
    "--fp8-format": "fp8", "--fp8-recipe": "fp8_recipe",
}  # fmt: skip
MCORE_BOOL = {
    "--sequence-parallel": "sequence_parallel", "--moe-grouped-gemm": "moe_grouped_gemm",
    "--overlap-moe-expert-parallel-comm": "overlap_moe_expert_parallel_comm",
    "--tp-comm-overlap": "tp_comm_overlap", "--swiglu": "gated_linear_unit", "--bf16": "bf16",
    "--multi-latent-attention": "multi_latent_attention",
}  # fmt: skip


def megatron_core_config(argv: list[str]):
    """Megatron-Core's TransformerConfig (MLATransformerConfig for MLA) built from argv."""
    import torch
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    kw: dict = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in MCORE_INT:
            kw[MCORE_INT[tok]], i = int(argv[i + 1]), i + 2
        elif tok in MCORE_STR:
            kw[MCORE_STR[tok]], i = argv[i + 1], i + 2
        elif tok == "--moe-layer-freq":  # Megatron's moe_freq_type evaluates the list expression
            kw["moe_layer_freq"], i = eval(argv[i + 1], {"__builtins__": {}}), i + 2
        else:
            kw.update({MCORE_BOOL[tok]: True} if tok in MCORE_BOOL else {})
            i += 1
    if kw.get("pipeline_model_parallel_size", 1) > 1:
        kw["pipeline_dtype"] = torch.bfloat16
    cls = MLATransformerConfig if kw.pop("multi_latent_attention", False) else TransformerConfig
    return cls(**kw)
