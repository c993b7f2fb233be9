"""The Clover model: a hybrid stack of memory and block-causal attention layers with MoE feed-forwards.

Two ways to run the same weights:

* `forward(input_ids, noisy_input_ids, block_sizes)`: the parallel two-stream training pass. The clean
  stream x_0 writes history (memory state, conv tails, keys and values); the noisy stream x_t of each
  block reads the history of the blocks before it and attends within its own block.
* `forward_block(input_ids, cache, commit)`: one block against a `CloverCache`, as the decoder runs it.
  With commit=False the block only reads history (a denoising step); with commit=True it is a clean
  block that is folded into the cache.

Both paths give the same noisy-stream logits (design invariant 2, tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from .config import MEMORY, CloverConfig
from .errors import CloverError
from .ops.gated_delta import chunk_gated_delta_rule, chunk_layout, gated_delta_readout
from .ops.moe import dispatch_experts

# ----------------------------------------------------------------------------------------------
# Layout of a training sequence: which block each token is in.


@dataclass
class BlockLayout:
    """A partition of L positions into blocks, with the index tensors every layer needs."""

    block_sizes: list[int]
    chunk_size: int
    block_id: torch.Tensor  # [L] block number of each position
    block_start: torch.Tensor  # [L] first position of the block
    block_end: torch.Tensor  # [L] one past the last position of the block
    chunk_index: torch.Tensor  # [N, C] positions packed into chunks of whole blocks, -1 = padding
    chunk_block: torch.Tensor  # [N, C] block number per chunk slot

    @classmethod
    def build(cls, block_sizes: list[int], chunk_size: int, device) -> BlockLayout:
        sizes = torch.tensor(block_sizes, dtype=torch.long)
        ends = sizes.cumsum(0)
        block_id = torch.repeat_interleave(torch.arange(len(block_sizes)), sizes)
        index, block_of_slot = chunk_layout(block_sizes, chunk_size)
        return cls(
            block_sizes=list(block_sizes),
            chunk_size=chunk_size,
            block_id=block_id.to(device),
            block_start=(ends - sizes)[block_id].to(device),
            block_end=ends[block_id].to(device),
            chunk_index=index.to(device),
            chunk_block=block_of_slot.to(device),
        )


def validate_block_sizes(block_sizes: list[int], length: int, max_block_size: int) -> None:
    if sum(block_sizes) != length:
        raise CloverError(f"block sizes sum to {sum(block_sizes)} but the sequence has {length} tokens")
    bad = sorted({s for s in block_sizes if not 1 <= s <= max_block_size})
    if bad:
        raise CloverError(f"block sizes {bad} are outside 1..{max_block_size} (the model's max_block_size)")


# ----------------------------------------------------------------------------------------------
# Decoding cache


@dataclass
class LayerCache:
    state: torch.Tensor | None = None  # memory: [B, H, Dk, Dv] fp32
    conv_tail: torch.Tensor | None = None  # memory: [B, r, C] last r pre-conv rows of committed tokens
    keys: torch.Tensor | None = None  # attention: [B, Hkv, T, D]
    values: torch.Tensor | None = None


@dataclass
class CloverCache:
    """Per-request history. Memory layers: constant size. Attention layers: grow with committed tokens."""

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0  # committed tokens

    @classmethod
    def empty(cls, config: CloverConfig) -> CloverCache:
        return cls(layers=[LayerCache() for _ in range(config.num_hidden_layers)])


# ----------------------------------------------------------------------------------------------
# Building blocks


class CloverRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


class CloverGatedRMSNorm(CloverRMSNorm):
    """Per-head RMSNorm times SiLU of a gate: Qwen3.5's output normalisation for linear attention."""

    def forward(self, x, gate):
        return super().forward(x) * F.silu(gate.float()).to(x.dtype)


def rotary(x, positions, theta: float):
    """Rotate pairs (i, i + D/2) of x [B, T, H, D] by angles positions[T] * theta^(-2i/D)."""
    dim = x.shape[-1]
    inv_freq = theta ** -(torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


class CloverMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CloverExperts(nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class CloverSparseMoeBlock(nn.Module):
    """Softmax top-k routing with renormalised weights, plus a shared expert behind a sigmoid gate.

    Balancing: `expert_bias` (DeepSeek-V3's auxiliary-loss-free bias) shifts which experts are chosen
    but never the gate weights; it is nudged towards uniform load after each optimiser step by
    `update_bias`. A small Switch-style auxiliary loss is returned as well.
    """

    use_grouped_mm: bool | None = None  # None: grouped_mm where torch has it, else the loop

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = CloverExperts(config)
        self.shared_expert = CloverMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts), persistent=True)
        self.register_buffer("expert_load", torch.zeros(config.num_experts), persistent=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x).float(), dim=-1)
        _, expert_ids = torch.topk(probs + self.expert_bias, self.top_k, dim=-1)
        weights = probs.gather(-1, expert_ids)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = dispatch_experts(
            x, expert_ids, weights, self.experts.gate_up_proj, self.experts.down_proj,
            use_grouped_mm=self.use_grouped_mm,
        )
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        aux_loss = x.new_zeros((), dtype=torch.float32)
        if self.training:
            counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).float()
            self.expert_load += counts.detach()
            fraction = counts / counts.sum()
            aux_loss = self.num_experts * (fraction * probs.mean(0)).sum()
        return (routed.to(shared.dtype) + shared).reshape(shape), aux_loss

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        if self.expert_load.sum() > 0:
            self.expert_bias += rate * torch.sign(self.expert_load.mean() - self.expert_load)
        self.expert_load.zero_()


def block_attention(q, k, v, layout: BlockLayout, temperature=None):
    """Bidirectional softmax attention within each block, all blocks at once.

    q, k, v [B, L, H, D] (same head count). Blocks are packed into chunks as in the delta rule so the
    cost is L x chunk, not L x L.
    """
    batch, length, heads, dim = q.shape
    index = layout.chunk_index
    valid = index >= 0
    gather = torch.where(valid, index, length)

    def to_chunks(x):
        x = torch.cat([x, x.new_zeros(x[:, :1].shape)], dim=1)[:, gather]  # [B, N, C, H, D]
        return x.permute(0, 1, 3, 2, 4)  # [B, N, H, C, D]

    same_block = layout.chunk_block[:, :, None] == layout.chunk_block[:, None, :]  # [N, C, C]
    scale = None
    qc = to_chunks(q)
    if temperature is not None:
        qc = qc * temperature.view(1, 1, heads, 1, 1).to(qc.dtype)
        scale = 1.0
    out = F.scaled_dot_product_attention(qc, to_chunks(k), to_chunks(v), attn_mask=same_block[:, None], scale=scale)
    out = out.permute(0, 1, 3, 2, 4).reshape(batch, -1, heads, v.shape[-1])
    result = out.new_empty(batch, length, heads, v.shape[-1])
    result[:, index[valid]] = out[:, valid.reshape(-1)]
    return result


# ----------------------------------------------------------------------------------------------
# Memory layer: the restructured Gated DeltaNet


class CloverMemoryMixer(nn.Module):
    """Local bidirectional conv, memory read-out from the delta-rule state, in-block attention, fusion.

    Names follow Qwen3.5's Qwen3_5MoeGatedDeltaNet where the parts correspond (in_proj_qkv, in_proj_z,
    in_proj_a, in_proj_b, conv1d, dt_bias, A_log, norm, out_proj); in_proj_lam (the fusion gate) and
    attn_log_temperature are Clover's own.
    """

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.radius = config.conv_radius
        self.rope_theta = config.rope_theta
        conv_dim = 2 * self.key_dim + self.value_dim
        h = config.hidden_size
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_lam = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.attn_log_temperature = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = CloverGatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    # -- pieces shared by both paths --

    def _conv(self, window):
        """Depthwise conv over rows already laid out as [B, r + n + r, C] -> [B, n, C] (valid conv)."""
        return F.silu(F.conv1d(window.transpose(1, 2), self.conv1d.weight, groups=window.shape[-1]).transpose(1, 2))

    def _split_heads(self, mixed):
        batch, length, _ = mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(batch, length, self.num_k_heads, self.head_k_dim))
        k = l2norm(k.reshape(batch, length, self.num_k_heads, self.head_k_dim))
        v = v.reshape(batch, length, self.num_v_heads, self.head_v_dim)
        groups = self.num_v_heads // self.num_k_heads
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        return q, k, v

    def _gates(self, x):
        beta = torch.sigmoid(self.in_proj_b(x).float())
        log_decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return log_decay, beta

    def _fuse(self, x, o_mem, o_attn):
        lam = torch.sigmoid(self.in_proj_lam(x).float())[..., None]
        o = (lam * o_mem.float() + (1 - lam) * o_attn.float()).to(x.dtype)
        batch, length = x.shape[:2]
        z = self.in_proj_z(x).reshape(batch, length, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o, z).reshape(batch, length, self.value_dim))

    def _temperature(self):
        # q and k are unit vectors: the learned temperature sets how sharp in-block attention can be.
        return self.attn_log_temperature.exp() * self.head_k_dim**0.5

    def _rope(self, q, k, positions):
        return rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)

    # -- training: both streams, all blocks --

    def forward_streams(self, x_noisy, x_clean, layout: BlockLayout, positions, cache: LayerCache | None = None):
        """Both streams over all blocks. x_noisy=None runs the clean stream only (prefill); a given
        (empty) cache receives the history the clean stream writes."""
        proj_clean = self.in_proj_qkv(x_clean)
        qc, kc, vc = self._split_heads(self._block_conv(proj_clean, proj_clean, layout))
        qn = None
        if x_noisy is not None:
            qn, kn, vn = self._split_heads(self._block_conv(self.in_proj_qkv(x_noisy), proj_clean, layout))
        log_decay, beta = self._gates(x_clean)
        mem_clean, final_state, mem_noisy, _ = chunk_gated_delta_rule(
            qc, kc, vc, log_decay, beta, block_sizes=layout.block_sizes, chunk_size=layout.chunk_size, q_noisy=qn
        )
        if cache is not None:
            cache.state = final_state
            cache.conv_tail = F.pad(proj_clean, (0, 0, self.radius, 0))[:, proj_clean.shape[1] :]
        temperature = self._temperature()
        qc_r, kc_r = self._rope(qc, kc, positions)
        out_clean = self._fuse(x_clean, mem_clean, block_attention(qc_r, kc_r, vc, layout, temperature))
        if x_noisy is None:
            return None, out_clean
        qn_r, kn_r = self._rope(qn, kn, positions)
        out_noisy = self._fuse(x_noisy, mem_noisy, block_attention(qn_r, kn_r, vn, layout, temperature))
        return out_noisy, out_clean

    def _block_conv(self, stream, clean, layout: BlockLayout):
        """The centred depthwise conv (then SiLU) of every block at once, [B, L, C] -> [B, L, C].

        Offsets before the block's start come from the clean (committed) history, offsets inside the block
        from `stream`, offsets past the block's end are zero: the future is unknown.
        """
        r = self.radius
        length = stream.shape[1]
        pad = lambda x: F.pad(x, (0, 0, r, r))
        stream_p, clean_p = pad(stream), pad(clean)
        positions = torch.arange(length, device=stream.device)
        out = 0
        for j in range(-r, r + 1):
            source = positions + j
            from_history = (source < layout.block_start)[None, :, None]
            inside = (source < layout.block_end)[None, :, None]
            rows = torch.where(from_history, clean_p[:, r + j : r + j + length], stream_p[:, r + j : r + j + length])
            rows = rows * inside.to(rows.dtype)
            out = out + rows * self.conv1d.weight[:, 0, j + r].to(rows.dtype)
        return F.silu(out)

    # -- decoding: one block against the cache --

    def forward_block(self, x, cache: LayerCache, positions, commit: bool):
        batch, n, _ = x.shape
        proj = self.in_proj_qkv(x)
        r = self.radius
        tail = cache.conv_tail if cache.conv_tail is not None else proj.new_zeros(batch, r, proj.shape[-1])
        window = torch.cat([tail.to(proj.dtype), proj, proj.new_zeros(batch, r, proj.shape[-1])], dim=1)
        q, k, v = self._split_heads(self._conv(window))
        state = cache.state
        if state is None:
            state = torch.zeros(batch, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=x.device)
        if commit:
            log_decay, beta = self._gates(x)
            o_mem, new_state, _, _ = chunk_gated_delta_rule(
                q, k, v, log_decay, beta, block_sizes=[n], chunk_size=max(n, 1), initial_state=state
            )
            cache.state = new_state
            cache.conv_tail = torch.cat([tail.to(proj.dtype), proj], dim=1)[:, -r:] if r else tail
        else:
            o_mem = gated_delta_readout(q, state)
        q_r, k_r = self._rope(q, k, positions)
        temperature = self._temperature().view(1, -1, 1, 1)
        o_attn = F.scaled_dot_product_attention(
            (q_r.transpose(1, 2) * temperature.to(q_r.dtype)), k_r.transpose(1, 2), v.transpose(1, 2), scale=1.0
        ).transpose(1, 2)
        return self._fuse(x, o_mem, o_attn)


# ----------------------------------------------------------------------------------------------
# Attention layer: block-causal softmax attention with a KV cache


class CloverAttention(nn.Module):
    """Grouped-query attention with rotary positions, q/k RMSNorm and Qwen3.5's sigmoid output gate.

    Block-causal: a token sees every committed token before its block and its whole block.
    """

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim * 2, bias=False)  # queries and output gate
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = CloverRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = CloverRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _project(self, x, positions):
        batch, length, _ = x.shape
        q, gate = self.q_proj(x).view(batch, length, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        q = rotary(self.q_norm(q), positions, self.rope_theta)
        k = rotary(self.k_norm(k), positions, self.rope_theta)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def _output(self, attn, gate):
        batch, _, length, _ = attn.shape
        out = attn.transpose(1, 2) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, length, -1))

    def _attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)

    def forward_streams(self, x_noisy, x_clean, layout: BlockLayout, positions, cache: LayerCache | None = None):
        """BD3-LM's mask over [x_t ; x_0]: noisy block b sees clean blocks < b and itself, clean b sees clean <= b.

        x_noisy=None runs the clean stream only (prefill); a given (empty) cache receives its keys and values.
        """
        block = layout.block_id
        same = block[:, None] == block[None, :]
        earlier = block[None, :] < block[:, None]
        if x_noisy is None:
            q, k, v, gate = self._project(x_clean, positions)
            if cache is not None:
                cache.keys, cache.values = k, v
            return None, self._output(self._attend(q, k, v, same | earlier), gate)
        length = x_noisy.shape[1]
        q, k, v, gate = self._project(torch.cat([x_noisy, x_clean], dim=1), torch.cat([positions, positions]))
        if cache is not None:
            cache.keys, cache.values = k[:, :, length:], v[:, :, length:]
        top = torch.cat([same, earlier], dim=1)  # noisy queries
        bottom = torch.cat([torch.zeros_like(same), same | earlier], dim=1)  # clean queries
        out = self._output(self._attend(q, k, v, torch.cat([top, bottom], dim=0)), gate)
        return out[:, :length], out[:, length:]

    def forward_block(self, x, cache: LayerCache, positions, commit: bool):
        q, k, v, gate = self._project(x, positions)
        if cache.keys is not None:
            keys, values = torch.cat([cache.keys, k], dim=2), torch.cat([cache.values, v], dim=2)
        else:
            keys, values = k, v
        if commit:  # only committed (clean) tokens ever enter the cache
            cache.keys, cache.values = keys, values
        return self._output(self._attend(q, keys, values, None), gate)


class CloverDecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = CloverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_type == MEMORY:
            self.linear_attn = CloverMemoryMixer(config)
        else:
            self.self_attn = CloverAttention(config)
        self.post_attention_layernorm = CloverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = CloverSparseMoeBlock(config)

    @property
    def mixer(self):
        return self.linear_attn if self.layer_type == MEMORY else self.self_attn

    def _feed_forward(self, h):
        out, aux = self.mlp(self.post_attention_layernorm(h))
        return h + out, aux

    def forward_streams(self, h_noisy, h_clean, layout, positions, cache: LayerCache | None = None):
        norm = self.input_layernorm
        mix_noisy, mix_clean = self.mixer.forward_streams(
            None if h_noisy is None else norm(h_noisy), norm(h_clean), layout, positions, cache
        )
        if h_noisy is None:
            h, aux = self._feed_forward(h_clean + mix_clean)
            return None, h, aux
        length = h_noisy.shape[1]
        # One MoE call over both streams: routing is per token, so this equals two calls.
        h, aux = self._feed_forward(torch.cat([h_noisy + mix_noisy, h_clean + mix_clean], dim=1))
        return h[:, :length], h[:, length:], aux

    def forward_block(self, h, cache: LayerCache, positions, commit: bool):
        h = h + self.mixer.forward_block(self.input_layernorm(h), cache, positions, commit)
        return self._feed_forward(h)[0]


# ----------------------------------------------------------------------------------------------
# transformers wrappers


class CloverPreTrainedModel(PreTrainedModel):
    config_class = CloverConfig
    config: CloverConfig
    base_model_prefix = "model"
    _no_split_modules = ["CloverDecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Conv1d):
            # centred kernel: start close to identity so early training sees the token itself
            module.weight.normal_(0.0, std)
            module.weight[:, 0, module.weight.shape[-1] // 2] += 1.0
        elif isinstance(module, CloverRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, CloverExperts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, CloverSparseMoeBlock):
            module.expert_bias.zero_()
        elif isinstance(module, CloverMemoryMixer):
            # Per-token decay a = exp(-exp(A_log) * softplus(dt_bias)) spread geometrically over
            # memory_decay_range across heads: slow heads keep a long prompt (design section 2b).
            lo, hi = self.config.memory_decay_range
            heads = module.A_log.shape[0]
            rates = torch.logspace(math.log10(-math.log(hi)), math.log10(-math.log(lo)), heads)
            module.dt_bias.fill_(0.5413248546129181)  # softplus(x) = 1
            module.A_log.copy_(rates.log())
            module.attn_log_temperature.zero_()


@dataclass
class CloverOutput(ModelOutput):
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class CloverModel(CloverPreTrainedModel):
    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CloverDecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = CloverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()


class CloverForBlockDiffusion(CloverPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.model = CloverModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def _check_ids(self, ids):
        if ids.numel() == 0:
            raise CloverError("empty input: at least one token is needed")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise CloverError(f"token ids must be in 0..{self.config.vocab_size - 1}")

    def forward(self, input_ids, noisy_input_ids=None, block_sizes=None, logits_mask=None, **kwargs) -> CloverOutput:
        """Two-stream training pass. input_ids = x_0, noisy_input_ids = x_t, both [B, L].

        block_sizes partitions L (default: one token per block). logits_mask [B, L] (bool) limits the
        vocabulary projection to the positions that are scored; logits then have shape [M, V].
        """
        self._check_ids(input_ids)
        batch, length = input_ids.shape
        if noisy_input_ids is None:
            noisy_input_ids = input_ids
        if noisy_input_ids.shape != input_ids.shape:
            raise CloverError(f"noisy_input_ids {tuple(noisy_input_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        block_sizes = list(block_sizes) if block_sizes is not None else [1] * length
        validate_block_sizes(block_sizes, length, self.config.max_block_size)
        layout = BlockLayout.build(block_sizes, self.config.max_block_size, input_ids.device)
        positions = torch.arange(length, device=input_ids.device)
        embed = self.model.embed_tokens
        h_noisy, h_clean = embed(noisy_input_ids), embed(input_ids)
        aux_total = h_noisy.new_zeros((), dtype=torch.float32)
        for layer in self.model.layers:
            h_noisy, h_clean, aux = layer.forward_streams(h_noisy, h_clean, layout, positions)
            aux_total = aux_total + aux
        hidden = self.model.norm(h_noisy)
        if logits_mask is not None:
            hidden = hidden[logits_mask]
        return CloverOutput(logits=self.lm_head(hidden), hidden_states=hidden, aux_loss=aux_total)

    def prefill(self, input_ids, block_sizes: list[int], cache: CloverCache) -> None:
        """Commit a whole prompt as clean blocks in one parallel pass (same result as block-by-block commits)."""
        self._check_ids(input_ids)
        if cache.length:
            raise CloverError("prefill needs an empty cache; commit further blocks with forward_block")
        length = input_ids.shape[1]
        validate_block_sizes(block_sizes, length, self.config.max_block_size)
        layout = BlockLayout.build(block_sizes, self.config.max_block_size, input_ids.device)
        positions = torch.arange(length, device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            _, h, _ = layer.forward_streams(None, h, layout, positions, layer_cache)
        cache.length = length

    def forward_block(self, input_ids, cache: CloverCache, commit: bool) -> torch.Tensor:
        """Run one block [B, n] against the cache; returns logits [B, n, V]. commit=True folds it in."""
        self._check_ids(input_ids)
        n = input_ids.shape[1]
        if n > self.config.max_block_size:
            raise CloverError(f"block size {n} is above the model's limit of {self.config.max_block_size}")
        positions = torch.arange(cache.length, cache.length + n, device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            h = layer.forward_block(h, layer_cache, positions, commit)
        if commit:
            cache.length += n
        return self.lm_head(self.model.norm(h))

    def moe_blocks(self) -> list[CloverSparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers]

    def update_router_bias(self) -> None:
        for block in self.moe_blocks():
            block.update_bias(self.config.router_bias_update_rate)


def register_auto_classes() -> None:
    from transformers import AutoConfig, AutoModel

    AutoConfig.register("clover", CloverConfig, exist_ok=True)
    AutoModel.register(CloverConfig, CloverForBlockDiffusion, exist_ok=True)
