"""Attention: bidirectional in-block attention over a block layout, and the block-causal attention layer
with its KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cloverlm.model.cache import DecodeBlock, LayerCache
from cloverlm.model.config import CloverConfig
from cloverlm.model.layers import CloverRMSNorm, rotary
from cloverlm.model.layout import BlockLayout, NoisyBlocks


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

    def _attend(self, q, k, v, mask=None, is_causal=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

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
        if x_noisy is None:
            q, k, v, gate = self._project(x_clean, positions)
            if cache is not None:
                cache.keys, cache.values, cache.used = k, v, k.shape[2]
            # a causal stream's mask as is_causal: the CPU flash kernel skips the tiles above the diagonal
            # only when told so (given the mask written out it computes them all: issue 28)
            attn = self._attend(q, k, v, is_causal=True) if self.causal_clean else self._attend(q, k, v, self._clean_mask(layout))
            return None, self._output(attn, gate)
        clean_mask = self._clean_mask(layout)
        if noisy is None:
            noisy = NoisyBlocks.of_layout(layout)
        if noisy.segments is not None and self.causal_clean and cache is None:
            return self._segmented_streams(x_noisy, x_clean, positions, noisy)
        length = x_noisy.shape[1]
        # the noisy layout is shared by the batch ([N]) or each row's own ([R, N]: packed rows)
        block, history, noisy_positions = (t if t.dim() == 2 else t[None] for t in (noisy.block, noisy.history, noisy.positions))
        rows = x_clean.shape[0]
        positions = torch.cat([noisy_positions.expand(rows, -1), positions.expand(rows, -1)], dim=1)
        q, k, v, gate = self._project(torch.cat([x_noisy, x_clean], dim=1), positions)
        if cache is not None:
            cache.keys, cache.values, cache.used = k[:, :, length:], v[:, :, length:], k.shape[2] - length
        clean_positions = torch.arange(x_clean.shape[1], device=x_clean.device)
        top = torch.cat([block[:, :, None] == block[:, None, :], clean_positions[None, None, :] < history[:, :, None]], 2)
        bottom = torch.cat([clean_mask.new_zeros(clean_mask.shape[0], length), clean_mask], dim=1)
        mask = torch.cat([top, bottom.expand(top.shape[0], -1, -1)], dim=1)[:, None]  # [R or 1, 1, T, T]
        out = self._output(self._attend(q, k, v, mask), gate)
        return out[:, :length], out[:, length:]

    def _segmented_streams(self, x_noisy, x_clean, positions, noisy: NoisyBlocks):
        """The dense mask's result at the cost of what it allows (a CPU kernel given a mask computes every
        tile): the clean stream through the causal kernel, and each segment's noisy slots against its clean
        prefix and its own slots, one small mask a segment. Keys and values are repeated to the query heads
        so that the backward splits over every head. Noisy padding slots (no segment) come out as zeros:
        nothing scored or real reads them."""
        rows = x_clean.shape[0]
        q, k, v, gate = self._project(x_clean, positions)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        clean = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        noisy_positions = noisy.positions if noisy.positions.dim() == 2 else noisy.positions[None].expand(rows, -1)
        qn, kn, vn, gate_n = self._project(x_noisy, noisy_positions)
        kn, vn = self._repeat_kv(kn), self._repeat_kv(vn)
        length = x_noisy.shape[1]
        out_rows = []
        for row, segments in enumerate(noisy.segments):
            pieces, done = [], 0
            for seg in segments:
                keys = torch.cat([k[row : row + 1, :, : seg.clean_keys], kn[row : row + 1, :, seg.start : seg.end]], 2)
                values = torch.cat([v[row : row + 1, :, : seg.clean_keys], vn[row : row + 1, :, seg.start : seg.end]], 2)
                query = qn[row : row + 1, :, seg.start : seg.end]
                pieces.append(F.scaled_dot_product_attention(query, keys, values, attn_mask=seg.mask))
                done = seg.end
            if done < length:
                pieces.append(qn.new_zeros(1, qn.shape[1], length - done, vn.shape[-1]))
            out_rows.append(torch.cat(pieces, 2))
        return self._output(torch.cat(out_rows), gate_n), self._output(clean, gate)

    def _repeat_kv(self, x):
        groups = self.num_heads // self.num_kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def forward_block(self, x, block: DecodeBlock, cache: LayerCache):
        """One block per row: it sees row b's first history[b] cached tokens and its own valid positions
        (the positions before it only, when committing under causal_clean_stream). Its keys are written
        into the cache's buffer in place; only a commit extends what the cache holds."""
        q, k, v, gate = self._project(x, block.positions)
        keys, values = cache.write_block(k, v, block)
        return self._output(self._attend(q, keys, values, block.key_mask), gate)

    def forward_commit_step(self, x_commit, x_step, commit: DecodeBlock, step: DecodeBlock, cache: LayerCache,
                            joint_mask: torch.Tensor):
        """forward_block on the block to commit and then on the block to denoise, as one projection and
        one attention call over joint_mask (cache.joint_key_mask): the same result, with one call's fixed
        cost instead of two and matmuls twice as tall (`make demo`'s Clover: 2.74 -> 2.50 s, models/README.md)."""
        n = x_commit.shape[1]
        q, k, v, gate = self._project(torch.cat([x_commit, x_step], 1), torch.cat([commit.positions, step.positions], 1))
        cache.write_block(k[:, :, :n], v[:, :, :n], commit)
        keys, values = cache.write_block(k[:, :, n:], v[:, :, n:], step)
        out = self._output(self._attend(q, keys, values, joint_mask), gate)
        return out[:, :n], out[:, n:]
