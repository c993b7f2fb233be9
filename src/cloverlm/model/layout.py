"""Layout of a training sequence: which block each token is in, and the block partition rules: the fixed one
(prefill, probes, bench) and the random one (training)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cloverlm.errors import CloverError
from cloverlm.ops.block_conv import boundary_rows
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
    _boundary_rows: dict = field(default_factory=dict, repr=False)  # per conv radius, built by the first layer

    def boundary_rows(self, radius: int) -> dict[int, torch.Tensor]:
        """The rows whose conv taps a block boundary changes (ops/block_conv.py), shared by all layers."""
        if radius not in self._boundary_rows:
            self._boundary_rows[radius] = boundary_rows(self.block_sizes, radius, self.block_id.device)
        return self._boundary_rows[radius]

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
class NoisySegment:
    """Noisy slots start..end of one packed row, and the one small mask that is all they attend through:
    [end - start, clean_keys + end - start], over the row's first clean_keys clean positions and then the
    segment's own slots. A segment is one or more whole examples, so no slot outside it is ever seen."""

    start: int
    end: int
    clean_keys: int
    mask: torch.Tensor


@dataclass
class NoisyBlocks:
    """The noisy stream as a list of block slots (docs/design.md section 7): slot i holds token ids[:, i] at
    position positions[i]; it sees the noisy slots of its own block (block[i]) bidirectionally and the
    clean positions below history[i]. Blocks may repeat (complementary masks) and skip the prompt.
    positions, block and history are shared by the batch ([N]) or given per row ([B, N], packed rows).

    `segments` (per row, packed rows only) lets attention skip what the mask forbids: the clean stream
    through a causal kernel and each segment's slots against their own keys (model/attention.py); None
    takes the one dense mask over both streams, the reference and CUDA's static-shape path."""

    input_ids: torch.Tensor  # [B, N]
    positions: torch.Tensor  # [N] or [B, N]
    block: torch.Tensor  # [N] or [B, N]
    history: torch.Tensor  # [N] or [B, N]
    segments: list[list[NoisySegment]] | None = None

    def to(self, device) -> NoisyBlocks:
        segments = self.segments and [
            [NoisySegment(s.start, s.end, s.clean_keys, s.mask.to(device)) for s in row] for row in self.segments
        ]
        moved = (t.to(device) for t in (self.input_ids, self.positions, self.block, self.history))
        return NoisyBlocks(*moved, segments=segments)

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


def block_partition(
    length: int, sizes, generator: torch.Generator, overhang: bool = True, chunk: int | None = None
) -> list[int]:
    """Blocks of sizes drawn uniformly from `sizes` until they cover `length` tokens: the last may overhang,
    or with overhang=False only sizes that fit are drawn (`length` a multiple of the smallest size).

    `chunk` (implies overhang=False) keeps every block inside one multiple of `chunk` tokens, so that chunks
    stay full: the chunked kernels' best case, which the from-scratch objective takes. Size 1 must then be
    in `sizes`, so that every remainder can be filled.
    """
    if chunk is not None:
        if 1 not in sizes:
            raise CloverError(f"block sizes {sizes} must include 1")
        if any(s > chunk or chunk % s for s in sizes):
            raise CloverError(f"block sizes {sizes} must divide the chunk of {chunk} tokens")
    partition, covered = [], 0
    while covered < length:
        room = length - covered if chunk is None else min(length - covered, chunk - covered % chunk)
        fitting = list(sizes) if overhang and chunk is None else [s for s in sizes if s <= room]
        size = fitting[int(torch.randint(len(fitting), (1,), generator=generator))]
        partition.append(size)
        covered += size
    return partition
