"""CloverConfig and the named presets.

Field names follow Qwen3.5-MoE's text config where the parts correspond (linear_* for the
Gated DeltaNet memory layers, moe_intermediate_size, shared_expert_intermediate_size, ...), so a
converter from its checkpoints stays a renaming exercise.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from cloverlm.errors import CloverError

# Stored with Qwen3.5's names (transformers validates layer_types against its own vocabulary);
# "memory" and "attention" are accepted as the friendlier spellings.
MEMORY, ATTENTION = "linear_attention", "full_attention"
LAYER_TYPES = (MEMORY, ATTENTION)
LAYER_TYPE_ALIASES = {"memory": MEMORY, "attention": ATTENTION}
MLP_TYPES = ("moe", "dense")
MEMORY_BLOCK_MIXING = ("attention", "delta")
# The chunked kernels pack blocks into chunks of this many tokens; a block never spans two, so it bounds
# the block size, and training rows are whole chunks.
CHUNK_SIZE = 64


class CloverConfig(PretrainedConfig):
    model_type = "clover"

    def __init__(
        self,
        vocab_size: int = 8192,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        layer_types: list[str] | None = None,
        rms_norm_eps: float = 1e-6,
        # RMSNorm scales by (1 + weight), weight starting at 0 (Qwen3.5's layer, final and q/k norms);
        # False: by weight, starting at 1. Only converted Qwen3.5 checkpoints set it: storing 1 + w
        # instead would round every norm scale to bf16's 8 bits near 1.
        rms_norm_zero_centered: bool = False,
        initializer_range: float = 0.02,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 65536,
        # block-causal attention layers
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int = 32,
        attention_output_gate: bool = True,  # Qwen3.5's sigmoid gate; Llama-family bases have none
        attention_qk_norm: bool = True,  # RMSNorm on q and k per head; Llama-family bases have none
        partial_rotary_factor: float = 1.0,  # rotary on the first head_dim * factor dims (Qwen3.5: 0.25)
        # Committed tokens attend causally inside their block (as the autoregressive base they were
        # converted from) instead of bidirectionally: docs/design.md section 7.
        causal_clean_stream: bool = False,
        # memory (restructured Gated DeltaNet) layers
        linear_num_key_heads: int = 4,
        linear_num_value_heads: int = 4,
        linear_key_head_dim: int = 32,
        linear_value_head_dim: int = 32,
        linear_conv_kernel_dim: int = 5,
        memory_decay_range: tuple[float, float] = (0.9, 0.9999),
        # How a memory layer mixes the tokens of its own block. "attention": Clover's bidirectional
        # in-block attention, fused with the history read-out by a learned gate (docs/design.md section 2b).
        # "delta": Qwen3.5's gated delta rule run causally over the block from the history state (a
        # scratch state, never committed): no fusion gate, no temperature; a converted Qwen3.5 base is
        # then the base at block size 1.
        memory_block_mixing: str = "attention",
        # feed-forward: "moe" (routed experts + shared expert) or "dense" (one SwiGLU, as a Llama base)
        mlp_type: str = "moe",
        intermediate_size: int = 0,  # the dense SwiGLU's width
        # mixture of experts
        num_experts: int = 64,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 64,
        shared_expert_intermediate_size: int = 128,
        router_aux_loss_coef: float = 0.001,
        router_bias_update_rate: float = 0.001,
        # block diffusion
        max_block_size: int = 64,
        mask_token_id: int = 2,
        pad_token_id: int = 1,
        eos_token_id: int = 0,
        bos_token_id: int | None = None,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.layer_types = [
            LAYER_TYPE_ALIASES.get(kind, kind)
            for kind in (layer_types if layer_types is not None else default_layer_types(num_hidden_layers))
        ]
        self.rms_norm_eps = rms_norm_eps
        self.rms_norm_zero_centered = rms_norm_zero_centered
        self.initializer_range = initializer_range
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.attention_output_gate = attention_output_gate
        self.attention_qk_norm = attention_qk_norm
        self.partial_rotary_factor = partial_rotary_factor
        self.causal_clean_stream = causal_clean_stream
        self.mlp_type = mlp_type
        self.intermediate_size = intermediate_size
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.memory_decay_range = tuple(memory_decay_range)
        self.memory_block_mixing = memory_block_mixing
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.router_aux_loss_coef = router_aux_loss_coef
        self.router_bias_update_rate = router_bias_update_rate
        self.max_block_size = max_block_size
        self.mask_token_id = mask_token_id
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        # Ours first: transformers' own layer_types check would raise a multi-line validation error.
        self.validate_sizes()
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def validate_sizes(self) -> None:
        """Raise CloverError with one line naming the inconsistent fields."""
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            problems.append(f"unknown layer types {unknown} (choose from memory, attention)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.linear_conv_kernel_dim % 2 == 0:
            problems.append(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be odd (a centred, bidirectional window)")
        if self.mlp_type not in MLP_TYPES:
            problems.append(f"mlp_type={self.mlp_type!r} is unknown (choose from {', '.join(MLP_TYPES)})")
        if self.mlp_type == "dense" and self.intermediate_size < 1:
            problems.append("a dense feed-forward needs intermediate_size >= 1")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
        if self.head_dim % 2 or self.linear_key_head_dim % 2:
            problems.append("head_dim and linear_key_head_dim must be even (rotary positions)")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            problems.append(f"partial_rotary_factor={self.partial_rotary_factor} must give an even rotary width in 2..head_dim")
        if self.memory_block_mixing not in MEMORY_BLOCK_MIXING:
            problems.append(f"memory_block_mixing={self.memory_block_mixing!r} is unknown (choose from {', '.join(MEMORY_BLOCK_MIXING)})")
        if not 1 <= self.max_block_size <= CHUNK_SIZE:
            problems.append(f"max_block_size={self.max_block_size} must be in 1..{CHUNK_SIZE}")
        for name in ("mask_token_id", "pad_token_id", "eos_token_id"):
            token = getattr(self, name)
            if token is not None and not 0 <= token < self.vocab_size:
                problems.append(f"{name}={token} is outside the vocabulary (vocab_size={self.vocab_size})")
        lo, hi = self.memory_decay_range
        if not 0 < lo <= hi < 1:
            problems.append(f"memory_decay_range={self.memory_decay_range} must satisfy 0 < lo <= hi < 1")
        if problems:
            raise CloverError("inconsistent config: " + "; ".join(problems))

    @property
    def conv_radius(self) -> int:
        return self.linear_conv_kernel_dim // 2

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of an attention head are rotated."""
        return int(self.head_dim * self.partial_rotary_factor)


def default_layer_types(num_layers: int) -> list[str]:
    """Three memory layers to one attention layer, attention last in each group of four (Qwen3.5)."""
    return [ATTENTION if (i + 1) % 4 == 0 else MEMORY for i in range(num_layers)]


PRESETS: dict[str, dict] = {
    # The CPU default: hybrid, 64 small experts so that total parameters exceed 4x active. A 9-tap conv:
    # keys that carry the 4 tokens before them let one attention layer copy digit strings, where 10
    # symbols make 2-token matches ambiguous (measured: a repeated 48-digit sequence is copied 99.9%
    # after 50 steps with 9 taps, 89% with 5).
    "clover-tiny": dict(linear_conv_kernel_dim=9),
    # Same model, memory layers only: the ablation for the hybrid stack and for constant cost per block.
    "clover-tiny-memory": dict(linear_conv_kernel_dim=9, layer_types=["memory"] * 4),
    # Reference presets (not trained here): laid out like Qwen3.5-MoE.
    "clover-1b-a0.3b": dict(
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=64,
        num_experts_per_tok=4,
        moe_intermediate_size=240,
        shared_expert_intermediate_size=512,
    ),
    "clover-35b-a3b": dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
    ),
}


def preset_config(name: str, **overrides) -> CloverConfig:
    if name not in PRESETS:
        raise CloverError(f"unknown preset '{name}'; choose from: {', '.join(PRESETS)}")
    return CloverConfig(**{**PRESETS[name], **overrides})


def parameter_counts(config: CloverConfig) -> dict[str, int]:
    """Total and active (per-token) parameters, computed from the config without building the model.

    Active counts what multiplies each token: the lm_head matrix, but not an untied input embedding
    table (a lookup), and only top-k of the routed experts.
    """
    c = config
    h = c.hidden_size
    lm_head = c.vocab_size * h
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    fusion = c.memory_block_mixing == "attention"  # in_proj_lam and attn_log_temperature exist
    memory = (
        h * (2 * key_dim + value_dim)  # in_proj_qkv
        + (2 * key_dim + value_dim) * c.linear_conv_kernel_dim  # depthwise conv1d
        + h * value_dim  # in_proj_z
        + (3 if fusion else 2) * h * c.linear_num_value_heads  # in_proj_b, in_proj_a (, in_proj_lam)
        + (3 if fusion else 2) * c.linear_num_value_heads  # dt_bias, A_log (, attn_log_temperature)
        + c.linear_value_head_dim  # gated norm
        + value_dim * h  # out_proj
    )
    attention = (
        h * c.num_attention_heads * c.head_dim * (2 if c.attention_output_gate else 1)  # q_proj (+ gate)
        + 2 * h * c.num_key_value_heads * c.head_dim  # k_proj, v_proj
        + c.num_attention_heads * c.head_dim * h  # o_proj
        + (2 * c.head_dim if c.attention_qk_norm else 0)  # q_norm, k_norm
    )
    if c.mlp_type == "dense":
        feed_forward_total = feed_forward_active = 3 * h * c.intermediate_size
    else:
        expert = 3 * h * c.moe_intermediate_size
        shared = 3 * h * c.shared_expert_intermediate_size + h + h * c.num_experts  # + gate, router
        feed_forward_total = shared + c.num_experts * expert
        feed_forward_active = shared + c.num_experts_per_tok * expert
    norms = 2 * h
    total = lm_head * (1 if c.tie_word_embeddings else 2) + h  # + final norm
    active = lm_head + h
    for kind in c.layer_types:
        mixer = memory if kind == MEMORY else attention
        total += mixer + norms + feed_forward_total
        active += mixer + norms + feed_forward_active
    return {"total_params": total, "active_params": active}


def human_count(n: int) -> str:
    exponent = min(int(math.log10(max(n, 1)) // 3), 4)
    return f"{n / 10 ** (3 * exponent):.2f}{['', 'K', 'M', 'B', 'T'][exponent]}"
