"""The block conv's fast form (shifted multiply-adds plus boundary corrections, its own backward) against the
tap-by-tap rule: outputs and the gradients of stream, clean and weight."""

import pytest
import torch

from cloverlm.model.layout import BlockLayout
from cloverlm.ops.block_conv import block_conv, block_conv_reference, boundary_rows

PARTITIONS = {
    "ones": [1] * 12,
    "mixed": [4, 1, 16, 3, 8, 2, 1, 12],
    "one block": [40],
    "shorter than radius": [2, 1, 2, 30, 1],
    "sequence shorter than radius": [3],
}


def _bounds(partition):
    """(block_start, block_end) of every position, as the model's layout gives them."""
    layout = BlockLayout.build(partition, max(partition), "cpu")
    return layout.block_start, layout.block_end


def _run(fn, stream, clean, weight, *extra):
    out = fn(stream, clean, weight, *extra)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    inputs = [stream, weight] + ([clean] if clean is not stream else [])
    return out, torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("partition", PARTITIONS.values(), ids=PARTITIONS.keys())
@pytest.mark.parametrize("radius", [1, 2, 4])
@pytest.mark.parametrize("two_streams", [False, True], ids=["clean only", "noisy and clean"])
def test_block_conv_matches_the_tap_by_tap_rule(partition, radius, two_streams):
    torch.manual_seed(0)
    length, channels = sum(partition), 6
    stream = torch.randn(2, length, channels, dtype=torch.float64, requires_grad=True)
    clean = torch.randn(2, length, channels, dtype=torch.float64, requires_grad=True) if two_streams else stream
    weight = torch.randn(channels, 1, 2 * radius + 1, dtype=torch.float64, requires_grad=True)
    want, want_grads = _run(block_conv_reference, stream, clean, weight, *_bounds(partition))
    got, got_grads = _run(block_conv, stream, clean, weight, boundary_rows(partition, radius))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_block_conv_in_bf16_stays_close_to_fp32():
    torch.manual_seed(0)
    partition = PARTITIONS["mixed"]
    stream, clean = torch.randn(2, sum(partition), 8), torch.randn(2, sum(partition), 8)
    weight = torch.randn(8, 1, 5)
    want = block_conv_reference(stream, clean, weight, *_bounds(partition))
    got = block_conv(stream.bfloat16(), clean.bfloat16(), weight, boundary_rows(partition, 2))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_boundary_rows_name_the_taps_a_boundary_changes():
    rows = boundary_rows([3, 2], 2, "cpu")  # blocks 0-2 and 3-4
    assert rows[1].tolist() == [2]  # row 4's next row is past the sequence: padding, no correction
    assert rows[2].tolist() == [1, 2]
    assert rows[-1].tolist() == [3]
    assert rows[-2].tolist() == [3, 4]  # row 1's tap -2 is before the sequence: padding
