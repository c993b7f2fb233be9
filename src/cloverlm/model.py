"""The Clover model: a hybrid stack of memory and block-causal attention layers with MoE feed-forwards.

Two ways to run the same weights:

* `forward(input_ids, noisy_input_ids, block_sizes)`: the parallel two-stream training pass. The clean
  stream x_0 writes history (memory state, conv tails, keys and values); the noisy stream x_t of each
  block reads the history of the blocks before it and attends within its own block.
* `forward_block(input_ids, cache, commit)`: one block against a `CloverCache`, as the decoder runs it.
  With commit=False the block only reads history (a denoising step); with commit=True it is a clean
  block that is folded into the cache.

Both paths give the same noisy-stream logits (docs/design.md invariant 2, tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from .cache import CloverCache, DecodeBlock, LayerCache
from .config import MEMORY, CloverConfig
from .errors import CloverError
from .ops.gated_delta import chunk_layout, gated_delta_readout, two_stream_gated_delta_rule
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


@dataclass
class NoisyBlocks:
    """The noisy stream as a list of block slots (docs/design.md section 7): slot i holds token ids[:, i] at
    position positions[i]; it sees the noisy slots of its own block (block[i]) bidirectionally and the
    clean positions below history[i]. Blocks may repeat (complementary masks) and skip the prompt."""

    input_ids: torch.Tensor  # [B, N]
    positions: torch.Tensor  # [N]
    block: torch.Tensor  # [N]
    history: torch.Tensor  # [N]

    @classmethod
    def of_layout(cls, layout: BlockLayout, input_ids=None) -> NoisyBlocks:
        """One noisy copy of every block of the clean stream, at the same positions."""
        positions = torch.arange(len(layout.block_id), device=layout.block_id.device)
        return cls(input_ids, positions, layout.block_id, layout.block_start)


def validate_block_sizes(block_sizes: list[int], length: int, max_block_size: int) -> None:
    if sum(block_sizes) != length:
        raise CloverError(f"block sizes sum to {sum(block_sizes)} but the sequence has {length} tokens")
    bad = sorted({s for s in block_sizes if not 1 <= s <= max_block_size})
    if bad:
        raise CloverError(f"block sizes {bad} are outside 1..{max_block_size} (the model's max_block_size)")


# ----------------------------------------------------------------------------------------------
# Building blocks


class CloverRMSNorm(nn.Module):
    """RMSNorm scaled by weight, or by (1 + weight) when zero_centered (config.rms_norm_zero_centered)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps

    @classmethod
    def of(cls, config: CloverConfig, dim: int) -> CloverRMSNorm:
        """The layer, final and q/k norms: the config's epsilon and centring."""
        return cls(dim, eps=config.rms_norm_eps, zero_centered=config.rms_norm_zero_centered)

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = 1.0 + self.weight.float() if self.zero_centered else self.weight
        return (weight * x).to(dtype)


class CloverGatedRMSNorm(CloverRMSNorm):
    """Per-head RMSNorm times SiLU of a gate: Qwen3.5's output normalisation for linear attention."""

    def forward(self, x, gate):
        return super().forward(x) * F.silu(gate.float()).to(x.dtype)


def rotary(x, positions, theta: float, rotary_dim: int | None = None):
    """Rotate pairs (i, i + D/2) of x [B, T, H, D] by angles positions * theta^(-2i/D).

    positions: [T] (shared by the batch) or [B, T] (rows at different offsets, as in batched decoding).
    rotary_dim < D: only the first rotary_dim dims are rotated (D := rotary_dim above), the rest pass.
    """
    dim = x.shape[-1]
    if rotary_dim is not None and rotary_dim < dim:
        return torch.cat([rotary(x[..., :rotary_dim], positions, theta), x[..., rotary_dim:]], dim=-1)
    inv_freq = theta ** -(torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv_freq
    if angles.dim() == 2:
        angles = angles[None]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
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
    # Data-parallel training sets this to a sum over ranks (distributed.wrap): the balancing loss and
    # the bias update then see the whole batch's load, exactly as one process would, on every rank.
    reduce_load = None

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
            if self.reduce_load is not None:
                self.reduce_load(counts)
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


def in_block_delta(q, k, v, log_decay, beta, layout: BlockLayout):
    """Split the gated delta rule run over each block alone, from the state S before it, into a history
    part and an in-block part: for slot i of block b (t <= i: the block's slots up to i),

        o_i = S^T q'_i / sqrt(Dk) + local_i,    q'_i = G_i q_i - sum_t P_it w_t,    local_i = sum_t P_it u_t / sqrt(Dk)

    with G the decay since the block's start, P_it = (q_i . k_t) G_i / G_t and u, w the block's WY
    corrections (the chunked form's, with the block as the chunk). S^T q' is what the two-stream rule
    returns for noisy queries, so every block reads its own history in one batched pass.
    q, k [B, L, H, Dk] (heads already repeated), v [B, L, H, Dv], log_decay, beta [B, L, H]; returns
    (q' [B, L, H, Dk], local [B, L, H, Dv] fp32).
    """
    batch, length, heads, dk = k.shape
    index = layout.chunk_index
    valid = index >= 0
    gather = torch.where(valid, index, length)

    def to_chunks(x):  # [B, L, H, ...] -> [B, H, N, C, ...], zero rows in padding slots
        x = x.float()
        return torch.cat([x, x.new_zeros(x[:, :1].shape)], dim=1)[:, gather].movedim(3, 1)

    qc, kc, vc, gc, bc = (to_chunks(x) for x in (q, k, v, log_decay, beta))
    size = index.shape[1]
    same_block = layout.chunk_block[:, :, None] == layout.chunk_block[:, None, :]  # [N, C, C]
    slots = torch.arange(size, device=k.device)
    causal = same_block & (slots[:, None] >= slots[None, :])
    strict = causal & (slots[:, None] > slots[None, :])
    # Log-decay since each block's start: the chunk's cumulative sum less what came before the block.
    cumulative = gc.cumsum(-1)
    first_slot = same_block.float().argmax(-1).expand_as(gc)
    g = cumulative - torch.gather(cumulative - gc, -1, first_slot)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = torch.eye(size, device=k.device) + (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    u = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, bc[..., None] * kc * g.exp()[..., None], upper=False, unitriangular=True)
    p = (qc @ kc.transpose(-1, -2)) * decay

    def from_chunks(x):  # [B, H, N, C, D] -> [B, L, H, D]
        x = x.movedim(1, 3).reshape(batch, -1, heads, x.shape[-1])
        out = x.new_empty(batch, length, heads, x.shape[-1])
        out[:, index[valid]] = x[:, valid.reshape(-1)]
        return out

    q_history = from_chunks(qc * g.exp()[..., None] - p @ w).to(q.dtype)
    return q_history, from_chunks(p @ u) * dk**-0.5


# ----------------------------------------------------------------------------------------------
# Memory layer: the restructured Gated DeltaNet


class CloverMemoryMixer(nn.Module):
    """Local bidirectional conv, memory read-out from the delta-rule state, in-block attention, fusion.

    Names follow Qwen3.5's Qwen3_5MoeGatedDeltaNet where the parts correspond (in_proj_qkv, in_proj_z,
    in_proj_a, in_proj_b, conv1d, dt_bias, A_log, norm, out_proj); in_proj_lam (the fusion gate) and
    attn_log_temperature are Clover's own.

    With config.memory_block_mixing = "delta" (converted Qwen3.5 bases) steps 3-5 become Qwen3.5's own:
    each block's tokens run causally through the delta rule from the history state, no in-block
    attention and no fusion gate (see `in_block_delta`).
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
        self.delta_mixing = config.memory_block_mixing == "delta"
        conv_dim = 2 * self.key_dim + self.value_dim
        h = config.hidden_size
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        if not self.delta_mixing:
            self.in_proj_lam = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        if not self.delta_mixing:
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
        return self._output(x, (lam * o_mem.float() + (1 - lam) * o_attn.float()).to(x.dtype))

    def _output(self, x, o):
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
        local = None
        if self.delta_mixing and x_noisy is not None:
            # The history part of each noisy block's causal pass is a read-out of S_{b-1} with
            # adjusted queries; the in-block part needs no history.
            qn, local = in_block_delta(qn, kn, vn, *self._gates(x_noisy), layout)
        mem_clean, final_state, mem_noisy = two_stream_gated_delta_rule(
            qc, kc, vc, log_decay, beta, block_sizes=layout.block_sizes, chunk_size=layout.chunk_size, q_noisy=qn
        )
        if cache is not None:
            cache.state = final_state
            cache.conv_tail = F.pad(proj_clean, (0, 0, self.radius, 0))[:, proj_clean.shape[1] :]
        if self.delta_mixing:
            out_clean = self._output(x_clean, mem_clean)
            if x_noisy is None:
                return None, out_clean
            return self._output(x_noisy, (mem_noisy.float() + local).to(x_noisy.dtype)), out_clean
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

    def forward_block(self, x, block: DecodeBlock, cache: LayerCache):
        """One block per row against the cache. x [B, n, h]; block.commit folds the valid positions into
        state and tail."""
        valid, positions, commit = block.valid, block.positions, block.commit
        r = self.radius
        # Padding rows are zero before the conv: exactly the zeros past a block's end.
        proj = self.in_proj_qkv(x) * valid[..., None].to(x.dtype)
        rows = torch.cat([cache.conv_tail.to(proj.dtype), proj], dim=1)
        window = torch.cat([rows, proj.new_zeros(proj.shape[0], r, proj.shape[-1])], dim=1)
        q, k, v = self._split_heads(self._conv(window))
        if commit or self.delta_mixing:
            log_decay, beta = self._gates(x)
            # beta = 0 and decay 1 at padding: those positions leave the state untouched.
            log_decay, beta = log_decay.masked_fill(~valid[..., None], 0.0), beta.masked_fill(~valid[..., None], 0.0)
            n = x.shape[1]
            o_mem, state, _ = two_stream_gated_delta_rule(
                q, k, v, log_decay, beta, block_sizes=[n], chunk_size=n, initial_state=cache.state
            )
            if commit:  # a denoising step under delta mixing wrote a scratch state: dropped
                cache.state = state
            if commit and r:
                ends = valid.sum(1)[:, None] + torch.arange(r, device=x.device)  # the last r committed rows
                cache.conv_tail = rows.gather(1, ends[..., None].expand(-1, -1, rows.shape[-1]))
        else:
            o_mem = gated_delta_readout(q, cache.state)
        if self.delta_mixing:
            return self._output(x, o_mem)
        q_r, k_r = self._rope(q, k, positions)
        temperature = self._temperature().view(1, -1, 1, 1)
        o_attn = F.scaled_dot_product_attention(
            (q_r.transpose(1, 2) * temperature.to(q_r.dtype)),
            k_r.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=block.block_mask,
            scale=1.0,
        ).transpose(1, 2)
        return self._fuse(x, o_mem, o_attn)


# ----------------------------------------------------------------------------------------------
# Attention layer: block-causal softmax attention with a KV cache


class CloverAttention(nn.Module):
    """Grouped-query attention with rotary positions, and (as in Qwen3.5) q/k RMSNorm and a sigmoid output
    gate, each optional so that a Llama-family base converts weight for weight.

    Block-causal: a token sees every committed token before its block and its whole block. With
    config.causal_clean_stream, committed (clean) tokens see only the tokens before them, as in the
    autoregressive base; the block being denoised still sees itself bidirectionally.
    """

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.rotary_dim = config.rotary_dim
        self.gated = config.attention_output_gate
        self.causal_clean = config.causal_clean_stream
        h = config.hidden_size
        q_width = self.num_heads * self.head_dim * (2 if self.gated else 1)  # queries (and output gate)
        self.q_proj = nn.Linear(h, q_width, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        if config.attention_qk_norm:
            self.q_norm = CloverRMSNorm.of(config, self.head_dim)
            self.k_norm = CloverRMSNorm.of(config, self.head_dim)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def _project(self, x, positions):
        batch, length, _ = x.shape
        gate = None
        if self.gated:
            q, gate = self.q_proj(x).view(batch, length, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        q = rotary(self.q_norm(q), positions, self.rope_theta, self.rotary_dim)
        k = rotary(self.k_norm(k), positions, self.rope_theta, self.rotary_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def _output(self, attn, gate):
        batch, _, length, _ = attn.shape
        out = attn.transpose(1, 2)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, length, -1))

    def _attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)

    def _clean_mask(self, layout: BlockLayout):
        """[L, L]: clean position i sees clean position j (causal, or block-causal)."""
        block = layout.block_id
        if self.causal_clean:
            positions = torch.arange(len(block), device=block.device)
            return positions[None, :] <= positions[:, None]
        return block[None, :] <= block[:, None]

    def forward_streams(self, x_noisy, x_clean, layout: BlockLayout, positions, cache: LayerCache | None = None,
                        noisy: NoisyBlocks | None = None):
        """BD3-LM's mask over [x_t ; x_0]: noisy block b sees the clean history before it and itself; clean
        position i sees the clean positions allowed by `_clean_mask`.

        The noisy stream is `noisy` (blocks with their own positions and history), or else one noisy copy
        of every block of `layout`. x_noisy=None runs the clean stream only (prefill); a given (empty)
        cache receives its keys and values.
        """
        clean_mask = self._clean_mask(layout)
        if x_noisy is None:
            q, k, v, gate = self._project(x_clean, positions)
            if cache is not None:
                cache.keys, cache.values, cache.used = k, v, k.shape[2]
            return None, self._output(self._attend(q, k, v, clean_mask), gate)
        if noisy is None:
            noisy = NoisyBlocks.of_layout(layout)
        length = x_noisy.shape[1]
        q, k, v, gate = self._project(torch.cat([x_noisy, x_clean], dim=1), torch.cat([noisy.positions, positions]))
        if cache is not None:
            cache.keys, cache.values, cache.used = k[:, :, length:], v[:, :, length:], k.shape[2] - length
        clean_positions = torch.arange(x_clean.shape[1], device=x_clean.device)
        top = torch.cat([noisy.block[:, None] == noisy.block[None, :], clean_positions[None, :] < noisy.history[:, None]], 1)
        bottom = torch.cat([clean_mask.new_zeros(clean_mask.shape[0], length), clean_mask], dim=1)
        out = self._output(self._attend(q, k, v, torch.cat([top, bottom], dim=0)), gate)
        return out[:, :length], out[:, length:]

    def forward_block(self, x, block: DecodeBlock, cache: LayerCache):
        """One block per row: it sees row b's first history[b] cached tokens and its own valid positions
        (the positions before it only, when committing under causal_clean_stream). Its keys are written
        into the cache's buffer in place; only a commit extends what the cache holds."""
        q, k, v, gate = self._project(x, block.positions)
        keys, values = cache.write_block(k, v, block)
        return self._output(self._attend(q, keys, values, block.key_mask), gate)


class CloverDecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = CloverRMSNorm.of(config, config.hidden_size)
        if layer_type == MEMORY:
            self.linear_attn = CloverMemoryMixer(config)
        else:
            self.self_attn = CloverAttention(config)
        self.post_attention_layernorm = CloverRMSNorm.of(config, config.hidden_size)
        if config.mlp_type == "dense":
            self.mlp = CloverMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = CloverSparseMoeBlock(config)

    @property
    def mixer(self):
        return self.linear_attn if self.layer_type == MEMORY else self.self_attn

    def _feed_forward(self, h):
        out = self.mlp(self.post_attention_layernorm(h))
        if isinstance(out, tuple):
            return h + out[0], out[1]
        return h + out, h.new_zeros((), dtype=torch.float32)

    def forward_streams(self, h_noisy, h_clean, layout, positions, cache: LayerCache | None = None, noisy=None):
        norm = self.input_layernorm
        extra = {} if noisy is None else {"noisy": noisy}
        mix_noisy, mix_clean = self.mixer.forward_streams(
            None if h_noisy is None else norm(h_noisy), norm(h_clean), layout, positions, cache, **extra
        )
        if h_noisy is None:
            h, aux = self._feed_forward(h_clean + mix_clean)
            return None, h, aux
        length = h_noisy.shape[1]
        # One MoE call over both streams: routing is per token, so this equals two calls.
        h, aux = self._feed_forward(torch.cat([h_noisy + mix_noisy, h_clean + mix_clean], dim=1))
        return h[:, :length], h[:, length:], aux

    def forward_decode(self, parts: list[tuple[torch.Tensor, DecodeBlock]], cache: LayerCache, skip_commit_ffn: bool = False):
        """The fused decoding step of one layer over (h [B, n, hidden], block) parts, the block to commit
        before the block to denoise: the clean block is folded into the cache first, then the next reads
        the updated history; one feed-forward call serves both (routing is per token). Returns the parts'
        new hidden states (None for a commit when skip_commit_ffn: on the last layer nothing reads it)."""
        mixed = [h + self.mixer.forward_block(self.input_layernorm(h), block, cache) for h, block in parts]
        live = [i for i, (_, block) in enumerate(parts) if not (skip_commit_ffn and block.commit)]
        if not live:
            return [None] * len(parts)
        # only real positions go through the experts; padding keeps its hidden state
        padded = any(parts[i][1].padded for i in live)
        rows = [mixed[i][parts[i][1].valid] if padded else mixed[i].flatten(0, 1) for i in live]
        flat = self._feed_forward(torch.cat(rows)[None])[0][0]
        start, out = 0, [None] * len(parts)
        for i, part_rows in zip(live, rows):
            piece = flat[start : start + len(part_rows)]
            start += len(part_rows)
            if padded:
                mixed[i][parts[i][1].valid] = piece.to(mixed[i].dtype)
                out[i] = mixed[i]
            else:
                out[i] = piece.view_as(mixed[i])
        return out


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
            module.weight.fill_(0.0 if module.zero_centered else 1.0)
        elif isinstance(module, CloverExperts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, CloverSparseMoeBlock):
            module.expert_bias.zero_()
        elif isinstance(module, CloverMemoryMixer):
            # Per-token decay a = exp(-exp(A_log) * softplus(dt_bias)) spread geometrically over
            # memory_decay_range across heads: slow heads keep a long prompt (docs/design.md section 2b).
            lo, hi = self.config.memory_decay_range
            heads = module.A_log.shape[0]
            rates = torch.logspace(math.log10(-math.log(hi)), math.log10(-math.log(lo)), heads)
            module.dt_bias.fill_(0.5413248546129181)  # softplus(x) = 1
            module.A_log.copy_(rates.log())
            if not module.delta_mixing:
                module.attn_log_temperature.zero_()


@dataclass
class CloverOutput(ModelOutput):
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    clean_logits: torch.Tensor | None = None


class CloverModel(CloverPreTrainedModel):
    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CloverDecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = CloverRMSNorm.of(config, config.hidden_size)
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

    def forward(
        self, input_ids, noisy_input_ids=None, block_sizes=None, logits_mask=None, noisy_blocks: NoisyBlocks | None = None,
        clean_logits_mask=None, **kwargs,
    ) -> CloverOutput:
        """Two-stream training pass over the clean stream input_ids = x_0 [B, L] and a noisy stream:
        either noisy_input_ids = x_t [B, L], one noisy copy of every block, or `noisy_blocks`, noisy
        copies of chosen blocks only (all-attention stacks; the prompt is then computed once).

        block_sizes partitions L (default: one token per block). logits_mask (bool, the noisy stream's
        shape) limits the vocabulary projection to the positions that are scored; logits are then [M, V].
        clean_logits_mask [B, L] adds the clean stream's logits at those positions (clean_logits).
        """
        self._check_ids(input_ids)
        batch, length = input_ids.shape
        if noisy_blocks is not None:
            if any(kind == MEMORY for kind in self.config.layer_types):
                raise CloverError("noisy_blocks needs an all-attention stack; give noisy_input_ids for memory layers")
            noisy_input_ids = noisy_blocks.input_ids
            self._check_ids(noisy_input_ids)
        elif noisy_input_ids is None:
            noisy_input_ids = input_ids
        elif noisy_input_ids.shape != input_ids.shape:
            raise CloverError(f"noisy_input_ids {tuple(noisy_input_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        block_sizes = list(block_sizes) if block_sizes is not None else [1] * length
        validate_block_sizes(block_sizes, length, self.config.max_block_size)
        layout = BlockLayout.build(block_sizes, self.config.max_block_size, input_ids.device)
        positions = torch.arange(length, device=input_ids.device)
        embed = self.model.embed_tokens
        h_noisy, h_clean = embed(noisy_input_ids), embed(input_ids)
        aux_total = h_noisy.new_zeros((), dtype=torch.float32)
        for layer in self.model.layers:
            h_noisy, h_clean, aux = layer.forward_streams(h_noisy, h_clean, layout, positions, noisy=noisy_blocks)
            aux_total = aux_total + aux
        hidden = self.model.norm(h_noisy)
        if logits_mask is not None:
            hidden = hidden[logits_mask]
        clean_logits = None
        if clean_logits_mask is not None:
            clean_logits = self.lm_head(self.model.norm(h_clean[clean_logits_mask]))
        return CloverOutput(logits=self.lm_head(hidden), hidden_states=hidden, aux_loss=aux_total, clean_logits=clean_logits)

    def prefill(self, input_ids, block_sizes: list[int], cache: CloverCache) -> torch.Tensor:
        """Commit a whole prompt as clean blocks in one parallel pass (same result as block-by-block commits).

        Returns the final (normed) hidden state of the last prompt token [B, hidden]."""
        self._check_ids(input_ids)
        if bool(cache.lengths.any()):
            raise CloverError("prefill needs an empty cache; commit further blocks with decode")
        batch, length = input_ids.shape
        if batch != cache.batch_size:
            raise CloverError(f"a prompt batch of {batch} rows against a cache of {cache.batch_size}")
        validate_block_sizes(block_sizes, length, self.config.max_block_size)
        layout = BlockLayout.build(block_sizes, self.config.max_block_size, input_ids.device)
        positions = torch.arange(length, device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            _, h, _ = layer.forward_streams(None, h, layout, positions, layer_cache)
        cache.lengths = torch.full_like(cache.lengths, length)
        return self.model.norm(h[:, -1])

    def decode(
        self, cache: CloverCache, commit_ids=None, commit_valid=None, step_ids=None, step_valid=None, return_hidden=False,
        step_causal=None,
    ):
        """One decoding forward for a batch of rows: commit a clean block and/or run a denoising step.

        commit_ids [B, nc] are folded into the cache (row b: its first commit_valid[b].sum() tokens), then
        step_ids [B, ns] read the updated history without writing it. Both in one pass: at every layer the
        clean block updates the cache before the new block reads it (docs/design.md section 4). Returns the step's
        logits [B, ns, V], or None without a step; with return_hidden, (logits, final normed hidden [B, ns, H]).
        step_causal [B, ns] bool marks step inputs that only the positions at and after them see (drafts).
        """
        if commit_ids is None and step_ids is None:
            raise CloverError("decode needs a block to commit or a block to denoise")
        parts = []
        history = cache.lengths
        for ids, valid, commit in ((commit_ids, commit_valid, True), (step_ids, step_valid, False)):
            if ids is None:
                continue
            self._check_ids(ids)
            if ids.shape[0] != cache.batch_size:
                raise CloverError(f"a block batch of {ids.shape[0]} rows against a cache of {cache.batch_size}")
            if ids.shape[1] > self.config.max_block_size:
                raise CloverError(f"block size {ids.shape[1]} is above the model's limit of {self.config.max_block_size}")
            valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid
            block = DecodeBlock.of(valid, history, commit, self.config.causal_clean_stream, None if commit else step_causal)
            parts.append((self.model.embed_tokens(ids), block))
            if commit:  # the block to denoise reads the history with the committed block in it
                history = history + valid.sum(1)
        layers = self.model.layers
        for index, (layer, layer_cache) in enumerate(zip(layers, cache.layers)):
            hidden = layer.forward_decode(parts, layer_cache, skip_commit_ffn=index == len(layers) - 1)
            parts = [(h, block) for h, (_, block) in zip(hidden, parts)]
        cache.lengths = history
        if step_ids is None:
            return (None, None) if return_hidden else None
        hidden = self.model.norm(parts[-1][0])
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    def forward_block(self, input_ids, cache: CloverCache, commit: bool) -> torch.Tensor | None:
        """Run one full block [B, n] against the cache: commit=True folds it in (returns None), else
        returns its logits [B, n, V]."""
        if commit:
            return self.decode(cache, commit_ids=input_ids)
        return self.decode(cache, step_ids=input_ids)

    def moe_blocks(self) -> list[CloverSparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, CloverSparseMoeBlock)]

    def update_router_bias(self) -> None:
        for block in self.moe_blocks():
            block.update_bias(self.config.router_bias_update_rate)


def register_auto_classes() -> None:
    from transformers import AutoConfig, AutoModel

    AutoConfig.register("clover", CloverConfig, exist_ok=True)
    AutoModel.register(CloverConfig, CloverForBlockDiffusion, exist_ok=True)
