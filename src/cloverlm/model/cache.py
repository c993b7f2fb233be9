"""The decoding cache and the typed input of one decoding forward.

A `CloverCache` holds each request's history (one row per request); a `DecodeBlock` says, for one part
of a decoding forward (the block to commit or the block to denoise), where each row's block sits.

Attention layers keep keys and values in preallocated buffers [B, Hkv, capacity, D]: a forward writes
its block's keys in place at each row's history length, then attends over the buffer's prefix, so a
forward costs O(block) writes, never a copy of the context. A denoising step's keys land past the
committed ones, where the next write overwrites them: history is only what `lengths` counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cloverlm.errors import CloverError
from cloverlm.model.config import MEMORY, CloverConfig

MIN_CAPACITY = 256  # attention positions allocated at least, so short prompts do not regrow each block


@dataclass
class DecodeBlock:
    """One block per row, as every layer of a decoding forward reads it. Built once per forward by
    `DecodeBlock.of`, so that the layers need no host synchronisation of their own."""

    valid: torch.Tensor  # [B, n]: row b's block is its first count_b positions, the rest is padding
    positions: torch.Tensor  # [B, n] absolute positions
    history: torch.Tensor  # [B] committed tokens the block sees (the cache's lengths, plus a fused commit)
    history_max: int  # max(history), on the host
    commit: bool  # fold the block into the cache (a clean block), or only read it (a denoising step)
    padded: bool  # some row's block has padding positions
    same_history: bool  # every row sees the same number of committed tokens
    key_mask: torch.Tensor | None  # [B, 1, n, history_max + n] over an attention buffer's prefix; None: all
    block_mask: torch.Tensor | None  # [B, 1, n, n] within the block; None: no padding

    @classmethod
    def of(cls, valid: torch.Tensor, history: torch.Tensor, commit: bool, causal_commit: bool,
           causal_inputs: torch.Tensor | None = None) -> DecodeBlock:
        """causal_commit: committed tokens see only the tokens before them (config.causal_clean_stream).
        causal_inputs [B, n] bool: block inputs that only the positions at and after them may see (drafts,
        docs/design.md section 4a). Information also flows through layers, so the flags must cover a
        suffix of the block: with every input from the first draft on flagged, no position ever reads,
        directly or through another position, a draft to its right."""
        batch, n = valid.shape
        if causal_inputs is not None and not bool(causal_inputs.any()):
            causal_inputs = None
        history_list = history.tolist()
        counts = valid.sum(1)
        history_max = max(history_list, default=0)
        all_valid = bool(valid.all())
        same_history = len(set(history_list)) <= 1
        uniform = same_history and all_valid
        causal = commit and causal_commit and n > 1
        device = valid.device
        key_mask = block_mask = None
        if not uniform or causal or causal_inputs is not None:
            keys = torch.arange(history_max + n, device=device)[None, None, :]  # [1, 1, W]
            itself = (history[:, None] + torch.arange(n, device=device))[:, :, None]  # [B, n, 1]
            # Every query sees itself, so a padding query never faces an empty row (softmax of nothing is NaN).
            visible = (keys < (history + counts)[:, None, None]) | (keys == itself)
            if causal:
                visible &= keys <= itself
            if causal_inputs is not None:
                drafted = torch.zeros(batch, history_max + n, dtype=torch.bool, device=device)
                drafted.scatter_(1, history[:, None] + torch.arange(n, device=device), causal_inputs)
                visible &= ~(drafted[:, None, :] & (keys > itself))
            key_mask = visible[:, None]
        if not all_valid or causal_inputs is not None:
            inside = valid[:, None, :] | torch.eye(n, dtype=torch.bool, device=device)[None]
            if causal_inputs is not None:
                later = torch.arange(n, device=device)[None, :] > torch.arange(n, device=device)[:, None]  # key after query
                inside &= ~(causal_inputs[:, None, :] & later[None])
            block_mask = inside[:, None]
        positions = history[:, None] + torch.arange(n, device=device)
        return cls(valid, positions, history, history_max, commit, not all_valid, same_history, key_mask, block_mask)

    def key_mask_over(self, width: int) -> torch.Tensor:
        """key_mask written out over a buffer prefix of `width` >= history_max + n keys: the keys past
        this block's own prefix are hidden (None stands for every key of that prefix)."""
        batch, n = self.valid.shape
        own = self.history_max + n
        mask = self.key_mask if self.key_mask is not None else self.valid.new_ones(batch, 1, n, own)
        return F.pad(mask, (0, width - own), value=False)


def joint_key_mask(commit: DecodeBlock, step: DecodeBlock) -> torch.Tensor:
    """[B, 1, nc + ns, step.history_max + ns]: a fused forward's commit and step queries as one attention
    call over the buffer both have written (the commit's keys first, then the step's, which overwrite
    the commit's padding slots). Each query sees exactly the keys it sees in a call of its own: the step
    reads the history with the commit in it, and no commit query reaches the step's keys (they sit at or
    past history + commit count, outside every commit query's mask but its own padding slot, whose output
    nothing reads)."""
    width = step.history_max + step.valid.shape[1]
    return torch.cat([commit.key_mask_over(width), step.key_mask_over(width)], dim=2)


@dataclass
class LayerCache:
    """One layer's history for a batch of rows.

    Memory layers: `state` [B, H, Dk, Dv] (fp32) and `conv_tail` [B, r, C], the last r pre-conv rows of
    committed tokens; both constant in the context length. Attention layers: `keys` / `values`
    [B, Hkv, capacity, D], of which the first `used` positions may be filled (row b up to its own
    length, the rest of the row is padding); capacity doubles when a write would pass it.
    """

    state: torch.Tensor | None = None
    conv_tail: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    used: int = 0

    def cached_kv(self):
        if self.keys is None:
            return None, None
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]

    def reserve(self, like: torch.Tensor, need: int) -> None:
        """Room for `need` positions per row, buffers shaped and typed like `like` [B, Hkv, n, D]."""
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        old = 0 if self.keys is None else self.keys.shape[2]
        capacity = max(need, 2 * old, MIN_CAPACITY)
        grown = [like.new_zeros(like.shape[0], like.shape[1], capacity, like.shape[3]) for _ in range(2)]
        if self.keys is not None:
            grown[0][:, :, : self.used], grown[1][:, :, : self.used] = self.cached_kv()
        self.keys, self.values = grown

    def write_block(self, k, v, block: DecodeBlock):
        """Write row b's block (all n positions, padding included) at history[b]..., and return the
        buffers' prefix that the block attends over: [B, Hkv, history_max + n, D] each."""
        n = k.shape[2]
        width = block.history_max + n
        self.reserve(k, width)
        if block.same_history:
            start = block.history_max
            self.keys[:, :, start:width] = k
            self.values[:, :, start:width] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            slots = block.history[:, None] + torch.arange(n, device=k.device)
            self.keys[rows, :, slots] = k.transpose(1, 2).to(self.keys.dtype)
            self.values[rows, :, slots] = v.transpose(1, 2).to(self.values.dtype)
        if block.commit:
            self.used = max(self.used, width)
        return self.keys[:, :, :width], self.values[:, :, :width]

    def nbytes(self) -> int:
        """Bytes of history held (attention: the filled positions, not the spare capacity)."""
        tensors = [self.state, self.conv_tail, *self.cached_kv()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class CloverCache:
    """Per-request history for a batch of rows. Memory layers: constant size. Attention layers: grow with
    committed tokens. Rows may hold different numbers of committed tokens (`lengths`)."""

    layers: list[LayerCache]
    lengths: torch.Tensor  # [B] committed tokens per row

    @classmethod
    def empty(cls, config: CloverConfig, batch: int = 1, device=None) -> CloverCache:
        layers = []
        for kind in config.layer_types:
            if kind == MEMORY:
                channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
                    config.linear_num_value_heads * config.linear_value_head_dim
                )
                dims = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
                layers.append(
                    LayerCache(
                        state=torch.zeros(batch, *dims, device=device),
                        conv_tail=torch.zeros(batch, config.conv_radius, channels, device=device),
                    )
                )
            else:
                layers.append(LayerCache())
        return cls(layers=layers, lengths=torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def reserve(self, tokens: int) -> None:
        """Preallocate room for `tokens` positions per row in every filled attention layer (e.g. prompt +
        answer budget after a prefill), so decoding never regrows a buffer."""
        for layer in self.layers:
            if layer.keys is not None:
                layer.reserve(layer.keys, tokens)

    def keep_written(self, counts: torch.Tensor) -> None:
        """Make the keys the last forward wrote past each row's history its history: counts [B] tokens
        per row. Right only where that forward's block ran exactly as its commit would (same inputs,
        same attention pattern), and only for attention layers: a memory state is written by commits."""
        if any(layer.state is not None for layer in self.layers):
            raise CloverError("keep_written needs an all-attention cache: memory layers fold blocks in by commits")
        self.lengths = self.lengths + counts.to(self.lengths.device)
        top = int(self.lengths.max())
        for layer in self.layers:
            if layer.keys is not None:
                layer.used = max(layer.used, top)

    def select(self, rows: list[int]) -> CloverCache:
        """The cache of a subset of rows (requests leaving the batch are dropped)."""
        if not rows:
            raise CloverError("select needs at least one row")
        index = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        lengths = self.lengths[index]
        layers = []
        for layer in self.layers:
            if layer.keys is None:
                layers.append(LayerCache(state=None if layer.state is None else layer.state[index],
                                         conv_tail=None if layer.conv_tail is None else layer.conv_tail[index]))
                continue
            # index_select keeps the capacity: the rows that stay do not regrow their buffers
            layers.append(LayerCache(keys=layer.keys[index], values=layer.values[index], used=int(lengths.max())))
        return CloverCache(layers=layers, lengths=lengths)

    @classmethod
    def concat(cls, caches: list[CloverCache]) -> CloverCache:
        """Stack the rows of several caches (requests joining a batch); attention history is right-padded."""
        layers = []
        for parts in zip(*(c.layers for c in caches)):
            first = parts[0]
            if first.state is not None:
                layers.append(
                    LayerCache(
                        state=torch.cat([p.state for p in parts]), conv_tail=torch.cat([p.conv_tail for p in parts])
                    )
                )
                continue
            filled = [p for p in parts if p.keys is not None]
            if not filled:
                layers.append(LayerCache())
                continue
            capacity = max(p.keys.shape[2] for p in filled)
            used = max(p.used for p in parts)
            template = filled[0].keys
            padded = []
            for part, cache in zip(parts, caches):
                if part.keys is None:
                    keys = values = template.new_zeros(cache.batch_size, template.shape[1], capacity, template.shape[3])
                else:
                    pad = (0, 0, 0, capacity - part.keys.shape[2])
                    keys, values = F.pad(part.keys, pad), F.pad(part.values, pad)
                padded.append((keys, values))
            layers.append(
                LayerCache(keys=torch.cat([k for k, _ in padded]), values=torch.cat([v for _, v in padded]), used=used)
            )
        return cls(layers=layers, lengths=torch.cat([c.lengths for c in caches]))

    def nbytes(self, kind: str) -> int:
        """Bytes held by the layers of one kind (config.MEMORY or config.ATTENTION) for all rows."""
        return sum(layer.nbytes() for layer in self.layers if (layer.state is not None) == (kind == MEMORY))
