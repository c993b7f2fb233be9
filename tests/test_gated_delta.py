"""Invariant 1: the chunked gated delta rule equals the token-by-token recurrence."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from cloverlm.ops.gated_delta import chunk_gated_delta_rule, gated_delta_readout, recurrent_gated_delta_rule


def inputs(batch=2, length=70, heads=3, dk=8, dv=12, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=g)
    log_decay = -torch.rand(batch, length, heads, generator=g) * 2  # decays from 1 down to e^-2
    beta = torch.rand(batch, length, heads, generator=g)
    state = torch.randn(batch, heads, dk, dv, generator=g)
    tensors = [q, k, v, log_decay, beta, state]
    if requires_grad:
        for t in tensors:
            t.requires_grad_(True)
    return tensors


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 16, 31, 64])
def test_chunked_equals_recurrence(chunk):
    q, k, v, g, b, s0 = inputs()
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, b, s0)
    o, s, _, states = chunk_gated_delta_rule(q, k, v, g, b, chunk_size=chunk, initial_state=s0)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)
    # the state at every chunk boundary is the recurrence's state at that position
    n = q.shape[1]
    ends = list(range(0, n, chunk)) + [n]
    for i, end in enumerate(ends):
        expected = s0 if end == 0 else recurrent_gated_delta_rule(q[:, :end], k[:, :end], v[:, :end], g[:, :end], b[:, :end], s0)[1]
        torch.testing.assert_close(states[:, i], expected, atol=1e-5, rtol=1e-5)


def test_reference_matches_transformers():
    q, k, v, g, b, s0 = inputs(length=20)
    ours, state = recurrent_gated_delta_rule(q, k, v, g, b, s0)
    theirs, their_state = torch_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, their_state, atol=1e-6, rtol=1e-5)


def test_noisy_readout_sees_state_before_its_block():
    q, k, v, g, b, s0 = inputs(length=49)
    q_noisy = inputs(length=49, seed=1)[0]
    sizes = [1, 4, 4, 8, 1, 16, 2, 13]
    _, _, o_noisy, _ = chunk_gated_delta_rule(q, k, v, g, b, block_sizes=sizes, chunk_size=16, initial_state=s0, q_noisy=q_noisy)
    start = 0
    for size in sizes:
        state = s0 if start == 0 else recurrent_gated_delta_rule(q[:, :start], k[:, :start], v[:, :start], g[:, :start], b[:, :start], s0)[1]
        expected = gated_delta_readout(q_noisy[:, start : start + size], state)
        torch.testing.assert_close(o_noisy[:, start : start + size], expected, atol=1e-5, rtol=1e-5)
        start += size


def test_strong_decay_does_not_overflow():
    q, k, v, g, b, s0 = inputs(length=64)
    g = g * 40  # per-token decay down to e^-80: exp of positive differences would overflow
    o, s, _, _ = chunk_gated_delta_rule(q, k, v, g, b, chunk_size=64, initial_state=s0)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, b, s0)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


def test_gradients_match_recurrence():
    a = inputs(length=24, requires_grad=True)
    b = [t.detach().clone().requires_grad_(True) for t in a]
    o1, s1 = recurrent_gated_delta_rule(*a)
    o2, s2, _, _ = chunk_gated_delta_rule(*b[:5], chunk_size=8, initial_state=b[5])
    weights = torch.randn_like(o1), torch.randn_like(s1)
    ((o1 * weights[0]).sum() + (s1 * weights[1]).sum()).backward()
    ((o2 * weights[0]).sum() + (s2 * weights[1]).sum()).backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad, x.grad, atol=1e-4, rtol=1e-4)


def test_noisy_readout_gradients_match_recurrence():
    sizes = [1, 4, 3, 8, 1, 5]
    a = inputs(length=sum(sizes), requires_grad=True) + [inputs(length=sum(sizes), seed=1)[0].requires_grad_(True)]
    b = [t.detach().clone().requires_grad_(True) for t in a]
    q, k, v, g, beta, s0, q_noisy = a
    expected, start = [], 0
    for size in sizes:  # each block's noisy queries read the state before the block
        state = s0 if start == 0 else recurrent_gated_delta_rule(q[:, :start], k[:, :start], v[:, :start], g[:, :start], beta[:, :start], s0)[1]
        expected.append(gated_delta_readout(q_noisy[:, start : start + size], state))
        start += size
    o, _, o_noisy, _ = chunk_gated_delta_rule(*b[:5], block_sizes=sizes, chunk_size=8, initial_state=b[5], q_noisy=b[6])
    weights = torch.randn_like(o), torch.randn_like(o)
    o_ref = recurrent_gated_delta_rule(*a[:6])[0]
    ((o_ref * weights[0]).sum() + (torch.cat(expected, 1) * weights[1]).sum()).backward()
    ((o * weights[0]).sum() + (o_noisy * weights[1]).sum()).backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad, x.grad, atol=1e-4, rtol=1e-4)


def test_blocks_longer_than_chunk_are_rejected():
    q, k, v, g, b, _ = inputs(length=20)
    with pytest.raises(ValueError, match="block sizes must be in 1..8"):
        chunk_gated_delta_rule(q, k, v, g, b, block_sizes=[10, 10], chunk_size=8)
