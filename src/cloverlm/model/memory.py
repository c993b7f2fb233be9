"""The memory layer: the restructured Gated DeltaNet (local bidirectional conv, delta-rule memory
read-out, in-block attention, learned fusion)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cloverlm.model.attention import block_attention
from cloverlm.model.cache import DecodeBlock, LayerCache
from cloverlm.model.config import CloverConfig
from cloverlm.model.layers import CloverGatedRMSNorm, l2norm, rotary
from cloverlm.model.layout import BlockLayout
from cloverlm.ops.block_conv import block_conv
from cloverlm.ops.gated_delta import gated_delta_readout, two_stream_gated_delta_rule


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
        """The centred depthwise conv (then SiLU) of every block at once, [B, L, C] -> [B, L, C]: history
        before a block's start, the stream inside it, zero past its end (ops/block_conv.py)."""
        return F.silu(block_conv(stream, clean, self.conv1d.weight, layout.boundary_rows(self.radius)))

    # -- decoding: one block against the cache --

    def forward_block(self, x, block: DecodeBlock, cache: LayerCache):
        """One block per row against the cache. x [B, n, h]; block.commit folds the valid positions into
        state and tail."""
        gates = self._gates(x) if block.commit or self.delta_mixing else None  # a plain read-out needs none
        return self._finish(x, *self._mix(self.in_proj_qkv(x), gates, block, cache))

    def forward_commit_step(self, x_commit, x_step, commit: DecodeBlock, step: DecodeBlock, cache: LayerCache,
                            joint_mask=None):
        """forward_block on the block to commit and then on the block to denoise, with every token-wise
        projection (qkv, gates, z, out) one call over both: at a block of 16 those calls cost their weights'
        bytes, read once instead of twice (models/README.md). joint_mask is the attention layers' (unused)."""
        n = x_commit.shape[1]
        x = torch.cat([x_commit, x_step], 1)
        proj, (log_decay, beta) = self.in_proj_qkv(x), self._gates(x)
        mixed = [self._mix(proj[:, part], (log_decay[:, part], beta[:, part]), block, cache)
                 for part, block in ((slice(None, n), commit), (slice(n, None), step))]
        o_mem = torch.cat([m[0] for m in mixed], 1)
        o_attn = None if self.delta_mixing else torch.cat([m[1] for m in mixed], 1)
        out = self._finish(x, o_mem, o_attn)
        return out[:, :n], out[:, n:]

    def _finish(self, x, o_mem, o_attn):
        return self._output(x, o_mem) if self.delta_mixing else self._fuse(x, o_mem, o_attn)

    def _mix(self, proj, gates, block: DecodeBlock, cache: LayerCache):
        """The memory read-out (and, without delta mixing, the in-block attention) of one block from its
        qkv projection and gates, against the cache; a commit updates state and conv tail."""
        valid, positions, commit = block.valid, block.positions, block.commit
        r = self.radius
        # Padding rows are zero before the conv: exactly the zeros past a block's end.
        proj = proj * valid[..., None].to(proj.dtype)
        rows = torch.cat([cache.conv_tail.to(proj.dtype), proj], dim=1)
        window = torch.cat([rows, proj.new_zeros(proj.shape[0], r, proj.shape[-1])], dim=1)
        q, k, v = self._split_heads(self._conv(window))
        if commit or self.delta_mixing:
            log_decay, beta = gates
            # beta = 0 and decay 1 at padding: those positions leave the state untouched.
            log_decay, beta = log_decay.masked_fill(~valid[..., None], 0.0), beta.masked_fill(~valid[..., None], 0.0)
            n = proj.shape[1]
            o_mem, state, _ = two_stream_gated_delta_rule(
                q, k, v, log_decay, beta, block_sizes=[n], chunk_size=n, initial_state=cache.state
            )
            if commit:  # a denoising step under delta mixing wrote a scratch state: dropped
                cache.state = state
            if commit and r:
                ends = valid.sum(1)[:, None] + torch.arange(r, device=proj.device)  # the last r committed rows
                cache.conv_tail = rows.gather(1, ends[..., None].expand(-1, -1, rows.shape[-1]))
        else:
            o_mem = gated_delta_readout(q, cache.state)
        if self.delta_mixing:
            return o_mem, None
        q_r, k_r = self._rope(q, k, positions)
        temperature = self._temperature().view(1, -1, 1, 1)
        o_attn = F.scaled_dot_product_attention(
            (q_r.transpose(1, 2) * temperature.to(q_r.dtype)),
            k_r.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=block.block_mask,
            scale=1.0,
        ).transpose(1, 2)
        return o_mem, o_attn
