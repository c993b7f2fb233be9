"""Per-GPU memory estimates for training (FSDP) and serving (expert parallelism): `clover info --plan N`.

Arithmetic from the config only, never a built model, so it runs for clover-35b-a3b on a laptop.
Every figure is in bytes; the assumptions behind each are spelled out where it is computed and in
docs/scaling.md.
"""

from __future__ import annotations

import math

from cloverlm.errors import CloverError
from cloverlm.model.config import ATTENTION, MEMORY, CloverConfig, parameter_counts

GIB = 2**30
# Mixed-precision Adam under FSDP, per parameter: bf16 weights (2), fp32 master copy (4), Adam's two
# fp32 moments (8), fp32 gradients (4). All four are sharded across the GPUs.
TRAIN_BYTES = {"weights_bf16": 2, "master_fp32": 4, "adam_fp32": 8, "grads_fp32": 4}
BF16 = 2
FP32 = 4
MASKED_FRACTION = 0.5  # t ~ U(0, 1): half of the positions are masked, and only those reach the lm_head
SERVING_HEADROOM = 0.9  # of a GPU's memory left after weights, the share given to caches
# The defaults of `clover info --plan`: a training micro-batch, a serving context, an 80 GB card.
PLAN_SEQ_LEN = 4096
PLAN_CONTEXT = 32768
PLAN_GPU_GIB = 80.0


def _mixer_sizes(c: CloverConfig) -> dict[str, int]:
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    return {
        "conv_dim": 2 * key_dim + value_dim,
        "value_dim": value_dim,
        "state": c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim,
        "kv_per_token": 2 * c.num_key_value_heads * c.head_dim,
    }


def expert_params(c: CloverConfig) -> int:
    """Parameters of one routed expert (gate, up and down projections)."""
    return 3 * c.hidden_size * c.moe_intermediate_size


def _layer_activation_values(c: CloverConfig) -> int:
    """Values (counted at 2 bytes) one decoder layer keeps for its backward per row of the 2S-row
    two-stream batch: a rough upper count of the tensors its forward saves, the bigger mixer of the two."""
    m = _mixer_sizes(c)
    memory = (
        2 * m["conv_dim"]  # in_proj_qkv output, conv output
        + 4 * c.linear_num_value_heads * c.linear_key_head_dim  # q, k (repeated to value heads), their rotations
        + 5 * m["value_dim"]  # memory read-out, in-block attention, fused, z, normed
        + m["state"] // 64  # the fused kernel keeps one state per 64-token chunk for its backward
    )
    q_width = c.num_attention_heads * c.head_dim
    attention = 5 * q_width + 4 * c.num_key_value_heads * c.head_dim  # q+gate, k, v, rotated, output, gated
    moe = (
        4 * c.num_experts  # router logits and probabilities in fp32 (2 values each)
        + c.num_experts_per_tok * (3 * c.hidden_size + 3 * c.moe_intermediate_size)  # sorted x, gate_up, act, out, weighted
        + 3 * c.shared_expert_intermediate_size
        + c.hidden_size
    )
    return max(memory, attention) + moe + 4 * c.hidden_size  # + the two norms and residuals


def training_plan(config: CloverConfig, gpus: int, seq_len: int = PLAN_SEQ_LEN) -> dict:
    """Bytes per GPU when training with FSDP (full sharding) over `gpus` GPUs, one sequence of
    `seq_len` tokens per GPU per micro-batch, bf16 autocast and activation checkpointing per layer."""
    c = config
    total = parameter_counts(c)["total_params"]
    per_param = {name: math.ceil(size * total / gpus) for name, size in TRAIN_BYTES.items()}
    # FSDP gathers one layer's full bf16 weights to run it, prefetches the next, and holds its bf16
    # gradients until the reduce-scatter: three layer-sized buffers, the biggest layer (or lm_head).
    m = _mixer_sizes(c)
    biggest_layer = c.num_experts * expert_params(c) + c.hidden_size * (m["conv_dim"] + 2 * m["value_dim"])
    gathered = 3 * BF16 * max(biggest_layer, c.vocab_size * c.hidden_size)
    rows = 2 * seq_len  # both streams go through every layer
    checkpoints = c.num_hidden_layers * rows * c.hidden_size * BF16
    # the layer being recomputed, plus an attention layer's [2S, 2S] boolean block-causal mask
    one_layer = rows * _layer_activation_values(c) * BF16 + (rows * rows if ATTENTION in c.layer_types else 0)
    # logits of the masked positions in bf16, their fp32 copy for the cross-entropy and its gradient
    logits = math.ceil(MASKED_FRACTION * seq_len) * c.vocab_size * (BF16 + FP32 + FP32)
    activations = checkpoints + one_layer + logits
    total_bytes = sum(per_param.values()) + gathered + activations
    return {
        "gpus": gpus,
        "seq_len": seq_len,
        **per_param,
        "fsdp_gathered": gathered,
        "activations": activations,
        "activation_parts": {"checkpoints": checkpoints, "one_layer": one_layer, "logits": logits},
        "total": total_bytes,
    }


def serving_plan(config: CloverConfig, gpus: int, context: int = PLAN_CONTEXT, gpu_gib: float = PLAN_GPU_GIB) -> dict:
    """Bytes per GPU when serving in bf16 with the routed experts split across `gpus` GPUs (expert
    parallelism) and everything else replicated; the cache of a request lives on the GPU serving it."""
    c = config
    total = parameter_counts(c)["total_params"]
    per_layer_experts = c.num_experts * expert_params(c)
    experts_per_gpu = math.ceil(c.num_experts / gpus)
    expert_bytes = c.num_hidden_layers * experts_per_gpu * expert_params(c) * BF16
    replicated = (total - c.num_hidden_layers * per_layer_experts) * BF16
    m = _mixer_sizes(c)
    memory_layers = c.layer_types.count(MEMORY)
    attention_layers = c.layer_types.count(ATTENTION)
    state = memory_layers * m["state"] * FP32  # the delta-rule state stays fp32 (decays compound)
    conv_tail = memory_layers * c.conv_radius * m["conv_dim"] * BF16
    kv_per_token = attention_layers * m["kv_per_token"] * BF16
    per_request = state + conv_tail + kv_per_token * context
    weights = expert_bytes + replicated
    free = gpu_gib * GIB - weights
    return {
        "gpus": gpus,
        "experts_per_gpu": experts_per_gpu,
        "expert_weights": expert_bytes,
        "replicated_weights": replicated,
        "weights": weights,
        "memory_state_per_request": state,
        "conv_tail_per_request": conv_tail,
        "kv_per_token": kv_per_token,
        "context": context,
        "cache_per_request": per_request,
        "gpu_gib": gpu_gib,
        "requests_per_gpu": max(0, math.floor(free * SERVING_HEADROOM / per_request)),
    }


def memory_plan(config: CloverConfig, gpus: int, *, seq_len: int = PLAN_SEQ_LEN, context: int = PLAN_CONTEXT, gpu_gib: float = PLAN_GPU_GIB) -> dict:
    if not isinstance(gpus, int) or gpus < 1:
        raise CloverError(f"--plan needs at least 1 GPU, got {gpus}")
    for name, value in (("--seq-len", seq_len), ("--context", context)):
        if not isinstance(value, int) or value < 1:
            raise CloverError(f"{name} must be at least 1 token, got {value}")
    if not gpu_gib > 0:
        raise CloverError(f"--gpu-gib must be positive, got {gpu_gib}")
    return {
        "training": training_plan(config, gpus, seq_len),
        "serving": serving_plan(config, gpus, context, gpu_gib),
    }


def format_plan(plan: dict) -> list[str]:
    gib = lambda n: f"{n / GIB:.2f} GiB"
    t, s = plan["training"], plan["serving"]
    a = t["activation_parts"]
    return [
        f"training, FSDP over {t['gpus']} GPU(s), per GPU (one {t['seq_len']}-token sequence, both streams, "
        "bf16 autocast, activation checkpointing per layer):",
        f"  weights bf16 {gib(t['weights_bf16'])}, master fp32 {gib(t['master_fp32'])}, "
        f"Adam fp32 {gib(t['adam_fp32'])}, grads fp32 {gib(t['grads_fp32'])}",
        f"  FSDP gathered layers {gib(t['fsdp_gathered'])}; activations {gib(t['activations'])} "
        f"(checkpoints {gib(a['checkpoints'])}, one layer {gib(a['one_layer'])}, logits {gib(a['logits'])})",
        f"  total {gib(t['total'])}",
        f"serving, experts split over {s['gpus']} GPU(s) ({s['experts_per_gpu']} per GPU per layer), bf16, per GPU:",
        f"  expert weights {gib(s['expert_weights'])} + replicated {gib(s['replicated_weights'])} = {gib(s['weights'])}",
        f"  per request: memory state {s['memory_state_per_request'] / 2**20:.1f} MiB + conv tails "
        f"{s['conv_tail_per_request'] / 2**20:.2f} MiB (fixed) + KV {s['kv_per_token'] / 2**10:.1f} KiB/token "
        f"= {gib(s['cache_per_request'])} at {s['context']} tokens",
        f"  requests at that context per {s['gpu_gib']:g} GiB GPU: {s['requests_per_gpu']}",
    ]
