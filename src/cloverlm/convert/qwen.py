"""Clover from a Qwen3.5-MoE checkpoint (docs/design.md section 7): the way to a real Clover-35B-A3B.

Qwen3.5-MoE is already Clover's layout (config.py names its fields after it), so the conversion is a
renaming exercise plus three config switches that make Clover compute what Qwen3.5 computes:

* memory layers (Qwen3.5's Gated DeltaNet) keep every weight. Qwen3.5's causal conv of K taps
  becomes Clover's centred conv of 2K - 1 taps whose K - 1 right (future) taps are zero: at block
  size 1 they only ever meet the zeros past the block's end, and fine-tuning may grow them into
  the bidirectional in-block features of docs/design.md section 2b. `memory_block_mixing="delta"` runs
  each block's tokens through the delta rule from the history state, as Qwen3.5 does, instead of
  Clover's in-block attention fused by a learned gate (which no Qwen3.5 weight could express:
  sigmoid(W h) never equals 1, and attention over one token is not a delta-rule write).
* attention layers keep q/k norm and the sigmoid output gate; `partial_rotary_factor` rotates only
  the first quarter of each head, as Qwen3.5 does.
* `rms_norm_zero_centered`: Qwen3.5's RMSNorms scale by (1 + w). Folding the 1 into w would be
  exact in fp32 but round every norm scale to bf16's 8 bits near 1 in a bf16 checkpoint.
* the MoE (softmax, top-k, renormalised weights, shared expert behind a sigmoid gate) is Clover's
  as it is; the balancing bias (Clover's own) starts at zero, so routing is unchanged.

Exact: under the shifted convention at block size 1, the converted model's logits are Qwen3.5's
(text positions only; Qwen3.5's multimodal rotary sections coincide for text). Not carried over:
the vision tower and the multi-token-prediction head (mtp.*), which a text Clover has no use for.

Run: `clover convert --base /path/to/Qwen3.5-35B-A3B --out models/clover-35b-a3b`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cloverlm.convert.base import base_folder, clover_from_state
from cloverlm.errors import CloverError
from cloverlm.model.config import LAYER_TYPES, MEMORY, CloverConfig

QWEN_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # the composite (vision + text) config, and its text part
DROPPED_PREFIXES = ("model.visual.", "mtp.")  # vision tower, multi-token prediction head
CHAT_END = "<|im_end|>"


def is_qwen_folder(path) -> bool:
    """Whether a model folder holds a Qwen3.5-MoE checkpoint (its config.json's model_type)."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") in QWEN_TYPES


def text_config(hf_config):
    """The text part of a Qwen3.5-MoE config; a one-line error for anything else."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in QWEN_TYPES:
        raise CloverError(f"cannot convert a '{kind}' checkpoint with convert_qwen (Qwen3.5-MoE only: model_type {' or '.join(QWEN_TYPES)})")
    return hf_config.text_config if kind == "qwen3_5_moe" else hf_config


def qwen_clover_config(hf_config, mask_token_id: int | None = None, eos_token_id: int | None = None) -> CloverConfig:
    """The Clover layout of a Qwen3.5-MoE config. mask_token_id defaults to the last embedding row,
    which real Qwen3.5 checkpoints pad past their tokenizer (the base never emits it)."""
    c = text_config(hf_config)
    rope = dict(c.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise CloverError(f"rotary scaling {rope.get('rope_type')!r} is not supported (plain rotary only)")
    if c.hidden_act != "silu":
        raise CloverError(f"the base's activation is {c.hidden_act}; Clover's conv and experts use silu")
    if getattr(c, "attention_bias", False):
        raise CloverError("bases with attention biases are not supported")
    unknown = sorted(set(c.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise CloverError(f"unknown Qwen3.5 layer types {unknown}")
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    eos = eos_token_id if eos_token_id is not None else eos
    return CloverConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        layer_types=list(c.layer_types),
        rms_norm_eps=c.rms_norm_eps,
        rms_norm_zero_centered=True,
        initializer_range=c.initializer_range,
        rope_theta=rope.get("rope_theta", 10000.0),
        max_position_embeddings=c.max_position_embeddings,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        attention_output_gate=True,
        attention_qk_norm=True,
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
        causal_clean_stream=True,  # committed tokens see what they saw in the base: the past only
        linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads,
        linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel_dim=2 * c.linear_conv_kernel_dim - 1,  # centred: K - 1 zero taps on the right
        memory_block_mixing="delta",
        mlp_type="moe",
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        router_aux_loss_coef=c.router_aux_loss_coef,
        mask_token_id=c.vocab_size - 1 if mask_token_id is None else mask_token_id,
        eos_token_id=eos,
        pad_token_id=c.pad_token_id if c.pad_token_id is not None else eos,
        bos_token_id=c.bos_token_id,
        tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", False),
    )


def convert_qwen_weights(hf_state_dict: dict, hf_config, clover_config: CloverConfig) -> dict:
    """Qwen3.5-MoE tensors under Clover's names (the same names, bar the prefix of a composite
    checkpoint). Tensors are shared, not copied, except the widened conv kernels."""
    text_config(hf_config)  # refuses anything but Qwen3.5-MoE
    state = {}
    for key, tensor in hf_state_dict.items():
        if key.startswith(DROPPED_PREFIXES) or key.endswith("rotary_emb.inv_freq"):
            continue
        key = key.replace("model.language_model.", "model.", 1)
        if key.endswith("linear_attn.conv1d.weight"):
            # Qwen's tap j (of K) multiplies x[t - (K-1) + j]; Clover's tap r + d multiplies x[t + d],
            # r = K - 1: the same offsets are Clover's first K taps, the K - 1 future taps start at zero.
            tensor = torch.cat([tensor, tensor.new_zeros(*tensor.shape[:2], tensor.shape[-1] - 1)], dim=-1)
        state[key] = tensor
    for index, kind in enumerate(clover_config.layer_types):
        prefix = f"model.layers.{index}."
        if f"{prefix}mlp.gate.weight" in state:  # Clover's balancing bias: zero changes no routing
            state[f"{prefix}mlp.expert_bias"] = torch.zeros(clover_config.num_experts, dtype=torch.float32)
        mixer = "linear_attn" if kind == MEMORY else "self_attn"
        if not any(k.startswith(prefix + mixer) for k in state):
            raise CloverError(f"layer {index} is {kind} in the config but the checkpoint has no {prefix}{mixer}.*")
    return state


def converted_qwen(hf_model, mask_token_id: int | None = None, eos_token_id: int | None = None):
    """A transformers Qwen3.5-MoE model (text or composite) as a Clover model, in memory."""
    config = qwen_clover_config(hf_model.config, mask_token_id, eos_token_id)
    state = convert_qwen_weights(hf_model.state_dict(), hf_model.config, config)
    return clover_from_state(config, state, "Qwen3.5")


def _tokenizer_ids(tokenizer, vocab_size: int, mask_token_id: int | None) -> tuple[int | None, int]:
    """(end of turn, mask) from the base tokenizer: the chat's <|im_end|> ends a Clover answer (the
    config's eos is the pretraining <|endoftext|>), and the mask defaults to the last embedding row,
    which must lie past the tokenizer's vocabulary."""
    ids = tokenizer(CHAT_END, add_special_tokens=False)["input_ids"]
    eos = ids[0] if len(ids) == 1 else None
    if mask_token_id is None:
        if len(tokenizer) >= vocab_size:
            raise CloverError(f"the tokenizer uses all {vocab_size} embedding rows: give mask_token_id (a token the base never emits)")
        mask_token_id = vocab_size - 1
    return eos, mask_token_id


def convert_qwen(folder_or_model, out_dir, mask_token_id: int | None = None, dtype=None):
    """Write a Clover model folder (checkpoint.save_model's layout) converted from a Qwen3.5-MoE folder
    or transformers model. A folder's tokenizer (with its own chat template) is saved alongside.
    dtype: the folder's load dtype (default: its own, bf16 for the released checkpoints). Returns out_dir."""
    from cloverlm.model.checkpoint import save_model

    tokenizer, eos = None, None
    if isinstance(folder_or_model, str | Path):
        folder = base_folder(str(folder_or_model))
        if not is_qwen_folder(folder):
            kind = json.loads((folder / "config.json").read_text()).get("model_type")
            raise CloverError(f"{folder} holds a '{kind}' model, not Qwen3.5-MoE (model_type {' or '.join(QWEN_TYPES)})")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        vocab_size = text_config(AutoConfig.from_pretrained(str(folder))).vocab_size
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            eos, mask_token_id = _tokenizer_ids(tokenizer, vocab_size, mask_token_id)
        # AutoModelForCausalLM maps qwen3_5_moe to the text-only model: the vision tower is never loaded.
        hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or "auto")
    else:
        hf_model = folder_or_model
    model = converted_qwen(hf_model, mask_token_id, eos)
    save_model(model, tokenizer, Path(out_dir))
    return Path(out_dir)
