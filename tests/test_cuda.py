"""The CUDA fast path of the memory layer (fla's fused gated-delta kernel, both streams interleaved).

On CPU (always run): the interleaved formulation of docs/design.md section 3, with the pure-PyTorch rule as
the kernel, equals the two-stream chunked rule (outputs, final states, gradients); and the model
wired to a stand-in with fla's calling convention gives the reference's logits, gradients and
decoding results. On CUDA with flash-linear-attention installed: fla's kernel against the
pure-PyTorch path, op by op and through the model.
"""

import pytest
import torch
import torch.nn.functional as F

from cloverlm import CloverCache, CloverError
from cloverlm.model.layers import CloverSparseMoeBlock
from cloverlm.ops import fla_backend
from cloverlm.ops.gated_delta import (
    chunk_gated_delta_rule,
    interleave_order,
    interleaved_two_stream,
    recurrent_gated_delta_rule,
    reference_kernel,
    two_stream_gated_delta_rule,
)
from conftest import tiny_model

SIZES = [1, 4, 4, 8, 1, 16, 2, 13, 64, 3]  # 116 tokens, blocks straddling the kernel's 64-token chunks


def inputs(batch=2, length=sum(SIZES), heads=3, dk=8, dv=12, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=g)
    log_decay = -torch.rand(batch, length, heads, generator=g)
    beta = torch.rand(batch, length, heads, generator=g)
    q_noisy = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    state = torch.randn(batch, heads, dk, dv, generator=g) * 0.1
    out = [q, k, v, log_decay, beta, q_noisy, state]
    # q, k, v and the noisy queries in the compute dtype; gates and state stay fp32 as the model has them
    return [t.to(device=device, dtype=dtype if i in (0, 1, 2, 5) else torch.float32) for i, t in enumerate(out)]


def leaves(tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def two_stream_reference(q, k, v, g, b, qn, s0):
    o, state, o_noisy, _ = chunk_gated_delta_rule(q, k, v, g, b, block_sizes=SIZES, chunk_size=64, initial_state=s0, q_noisy=qn)
    return o, state, o_noisy


def backward(outputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outputs)
    loss.backward()


# ----------------------------------------------------------------------------------------------
# CPU: the interleaved formulation


def test_interleave_order_places_each_noisy_block_before_its_clean_block():
    order, inverse = interleave_order([2, 1, 3])
    # rows 0..5 are the noisy stream, 6..11 the clean one
    assert order.tolist() == [0, 1, 6, 7, 2, 8, 3, 4, 5, 9, 10, 11]
    assert order[inverse].tolist() == list(range(12))


def recurrent_kernel(q, k, v, g, b, s0=None):
    return recurrent_gated_delta_rule(q, k, v, g, b, s0)


@pytest.mark.parametrize("kernel", [reference_kernel, recurrent_kernel], ids=["chunked", "recurrent"])
def test_interleaved_equals_two_stream(kernel):
    """beta = 0 and log-decay = 0 at noisy positions: they read S_{b-1} and write nothing."""
    a = leaves(inputs())
    b = leaves(a)
    expected = two_stream_reference(*a)
    q, k, v, g, beta, qn, s0 = b
    got = interleaved_two_stream(q, k, v, g, beta, qn, SIZES, kernel, initial_state=s0)
    for name, x, y in zip(("clean output", "final state", "noisy output"), got, expected):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)
    backward(expected)
    backward(got)
    for name, x, y in zip(("q", "k", "v", "log_decay", "beta", "q_noisy", "initial_state"), b, a):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


def fake_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
    """Stands in for fla.ops.gated_delta_rule.chunk_gated_delta_rule on CPU: holds our adapter to fla's
    documented convention ([B, T, H, D], g the natural log of the decay, beta after the sigmoid,
    state [B, H, Dk, Dv]) and computes with the recurrence."""
    assert not kwargs, kwargs
    batch, length, heads, dk = q.shape
    assert k.shape == q.shape and v.shape[:3] == (batch, length, heads)
    assert g.shape == beta.shape == (batch, length, heads)
    assert q.dtype == k.dtype == v.dtype == beta.dtype and g.dtype == torch.float32
    assert all(t.is_contiguous() for t in (q, k, v, g, beta))
    assert bool((g <= 0).all()) and bool(((beta >= 0) & (beta <= 1)).all())
    assert scale == dk**-0.5 and not use_qk_l2norm_in_kernel
    assert initial_state is None or (initial_state.shape == (batch, heads, dk, v.shape[-1]) and initial_state.dtype == torch.float32)
    o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
    return o, (state if output_final_state else None)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(fla_backend, "_fla_function", fake_fla)
    monkeypatch.setattr(fla_backend, "DEVICES", ("cpu",))
    monkeypatch.setattr(fla_backend, "BACKEND", "auto")


def test_dispatch_uses_the_fused_kernel_when_it_is_there(stand_in, monkeypatch):
    calls = []
    monkeypatch.setattr(fla_backend, "_fla_function", lambda *a, **kw: calls.append(1) or fake_fla(*a, **kw))
    q, k, v, g, b, qn, s0 = inputs()
    got = two_stream_gated_delta_rule(q, k, v, g, b, block_sizes=SIZES, chunk_size=64, q_noisy=qn, initial_state=s0)
    assert calls == [1]  # both streams in one call
    for x, y in zip(got, two_stream_reference(q, k, v, g, b, qn, s0)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(fla_backend, "BACKEND", "torch")
    two_stream_gated_delta_rule(q, k, v, g, b, block_sizes=SIZES, chunk_size=64, q_noisy=qn)
    assert calls == [1]


def model_run(model, x0, xt, sizes):
    """Training logits and gradients, then the decoding path: prefill, fused commit + step."""
    model.zero_grad()
    logits = model(x0, xt, sizes).logits
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        cache = CloverCache.empty(model.config, batch=x0.shape[0], device=x0.device)
        prefix = sum(sizes[:-2])
        model.prefill(x0[:, :prefix], sizes[:-2], cache)
        nxt = prefix + sizes[-2]
        decoded = model.decode(cache, commit_ids=x0[:, prefix:nxt], step_ids=xt[:, nxt:]).logits
    return logits.detach(), grads, decoded


def test_model_on_the_fused_path_matches_the_reference(stand_in, monkeypatch):
    model = tiny_model().train()
    sizes = [1, 4, 8, 2, 8, 1, 4]
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(3, 300, (2, sum(sizes)), generator=g)
    xt = torch.where(torch.rand(x0.shape, generator=g) < 0.5, torch.full_like(x0, 2), x0)
    fused = model_run(model, x0, xt, sizes)
    monkeypatch.setattr(fla_backend, "BACKEND", "torch")
    reference = model_run(model, x0, xt, sizes)
    torch.testing.assert_close(fused[0], reference[0], atol=1e-4, rtol=1e-4)
    assert fused[1].keys() == reference[1].keys()
    for name in reference[1]:
        torch.testing.assert_close(fused[1][name], reference[1][name], atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(fused[2], reference[2], atol=1e-4, rtol=1e-4)


def test_backend_choice_errors(monkeypatch):
    q = torch.zeros(1, 2, 1, 4)
    monkeypatch.setattr(fla_backend, "BACKEND", "fla")
    with pytest.raises(CloverError, match="needs CUDA tensors and flash-linear-attention"):
        fla_backend.kernel_for(q)
    monkeypatch.setattr(fla_backend, "BACKEND", "triton")
    with pytest.raises(CloverError, match="CLOVER_GDN_BACKEND='triton' is not one of auto, torch, fla"):
        fla_backend.kernel_for(q)


# ----------------------------------------------------------------------------------------------
# CUDA: fla's kernel against the pure-PyTorch path

needs_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or fla_backend.fla_chunk_function() is None,
    reason="needs a CUDA device and flash-linear-attention (pip install -e '.[cuda]')",
)


def relative_error(x, y):
    return float((x.float() - y.float()).norm() / y.float().norm().clamp(min=1e-12))


# fla's kernels use tensor cores (TF32 for fp32 inputs); bf16 inputs round q, k, v to 8 bits of mantissa.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_two_stream_matches_reference(dtype, monkeypatch):
    base = inputs(heads=4, dk=64, dv=64, device="cuda", dtype=dtype)
    a, b = leaves(base), leaves(base)
    monkeypatch.setattr(fla_backend, "BACKEND", "fla")
    q, k, v, g, beta, qn, s0 = a
    fused = two_stream_gated_delta_rule(q, k, v, g, beta, block_sizes=SIZES, chunk_size=64, q_noisy=qn, initial_state=s0)
    reference = two_stream_reference(*b)
    for name, x, y in zip(("clean output", "final state", "noisy output"), fused, reference):
        assert relative_error(x, y) < TOLERANCE[dtype], name
    backward(fused)
    backward(reference)
    for name, x, y in zip(("q", "k", "v", "log_decay", "beta", "q_noisy", "initial_state"), a, b):
        assert relative_error(x.grad, y.grad) < TOLERANCE[dtype], f"gradient of {name}"


@needs_fla
def test_fla_commit_with_state_and_padding(monkeypatch):
    q, k, v, g, beta, _, s0 = inputs(length=16, heads=4, dk=64, dv=64, device="cuda")
    valid = torch.arange(16, device="cuda")[None, :] < torch.tensor([[16], [5]], device="cuda")
    g, beta = g.masked_fill(~valid[..., None], 0.0), beta.masked_fill(~valid[..., None], 0.0)
    monkeypatch.setattr(fla_backend, "BACKEND", "fla")
    o, state, _ = two_stream_gated_delta_rule(q, k, v, g, beta, block_sizes=[16], chunk_size=16, initial_state=s0)
    o_ref, state_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert state.dtype == torch.float32
    assert relative_error(o[valid], o_ref[valid]) < 5e-3
    assert relative_error(state, state_ref) < 5e-3


@needs_fla
@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-memory"])
def test_fla_model_matches_reference(preset, monkeypatch):
    model = tiny_model(preset, linear_key_head_dim=32, linear_value_head_dim=32).cuda().train()
    # fp32 on purpose: the loop dispatch, so that only the memory kernel differs between the two runs
    # (grouped_mm is checked in bf16 below)
    monkeypatch.setattr(CloverSparseMoeBlock, "use_grouped_mm", False)
    sizes = [1, 4, 8, 2, 16, 1, 32, 4, 64]
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(3, 300, (2, sum(sizes)), generator=g).cuda()
    xt = torch.where(torch.rand(x0.shape, generator=g).cuda() < 0.5, torch.full_like(x0, 2), x0)
    monkeypatch.setattr(fla_backend, "BACKEND", "fla")
    fused = model_run(model, x0, xt, sizes)
    monkeypatch.setattr(fla_backend, "BACKEND", "torch")
    reference = model_run(model, x0, xt, sizes)
    assert relative_error(fused[0], reference[0]) < 5e-3
    worst = max(relative_error(fused[1][n], reference[1][n]) for n in reference[1])
    assert worst < 2e-2
    assert relative_error(fused[2], reference[2]) < 5e-3


@needs_fla
def test_fla_two_stream_equals_decoding_path_bf16(monkeypatch):
    """Design invariant 2 on the fused path, in bf16 autocast as training and serving run."""
    model = tiny_model(linear_key_head_dim=32, linear_value_head_dim=32).cuda()
    sizes = [4, 8, 1, 16, 3]
    g = torch.Generator().manual_seed(1)
    x0 = torch.randint(3, 300, (2, sum(sizes)), generator=g).cuda()
    xt = torch.where(torch.rand(x0.shape, generator=g).cuda() < 0.5, torch.full_like(x0, 2), x0)
    monkeypatch.setattr(fla_backend, "BACKEND", "fla")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        parallel = model(x0, xt, sizes).logits.float()
        cache = CloverCache.empty(model.config, batch=2, device="cuda")
        start = 0
        for size in sizes:
            step = model.decode(cache, step_ids=xt[:, start : start + size]).logits.float()
            assert relative_error(step, parallel[:, start : start + size]) < 3e-2
            model.decode(cache, commit_ids=x0[:, start : start + size])
            start += size


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_equals_loop_on_cuda():
    from cloverlm.ops.moe import dispatch_experts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).cuda().bfloat16()
    ids = torch.randint(0, 8, (64, 2), generator=g).cuda()
    weights = torch.rand(64, 2, generator=g).cuda()
    gate_up = (torch.randn(8, 2 * 64, 128, generator=g) * 0.05).cuda().bfloat16()
    down = (torch.randn(8, 128, 64, generator=g) * 0.05).cuda().bfloat16()
    grouped = dispatch_experts(x, ids, weights, gate_up, down, use_grouped_mm=True)
    loop = dispatch_experts(x, ids, weights, gate_up, down, use_grouped_mm=False)
    assert relative_error(grouped, loop) < 2e-2
