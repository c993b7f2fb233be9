"""Layout of a training sequence: which block each token is in, and the block partition rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloverlm.errors import CloverError
from cloverlm.ops.gated_delta import chunk_layout


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
    clean positions below history[i]. Blocks may repeat (complementary masks) and skip the prompt.
    positions, block and history are shared by the batch ([N]) or given per row ([B, N], packed rows)."""

    input_ids: torch.Tensor  # [B, N]
    positions: torch.Tensor  # [N] or [B, N]
    block: torch.Tensor  # [N] or [B, N]
    history: torch.Tensor  # [N] or [B, N]

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




def fixed_partition(length: int, block_size: int) -> list[int]:
    """Blocks of `block_size` covering `length` positions, the last one shorter when it does not divide."""
    if block_size < 1:
        raise CloverError(f"block size must be at least 1, got {block_size}")
    return [block_size] * (length // block_size) + ([length % block_size] if length % block_size else [])
