"""flash-linear-attention's fused gated-delta kernel, used for CUDA tensors when `fla` imports.

Only the calling convention lives here; the math stays in `gated_delta.py`, whose pure-PyTorch code
is the reference and the path everywhere else (CPU, no fla). fla's `chunk_gated_delta_rule` takes
[B, T, H, D] tensors (not head-first), `g` as the natural log of the per-token decay, `beta` after the
sigmoid, a float state [B, H, Dk, Dv] and returns (o, final_state).

CLOVER_GDN_BACKEND=torch forces the reference on CUDA too (comparisons, debugging); =fla makes a
missing fla an error instead of a silent fallback. It is read at import; tests set `BACKEND`.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from cloverlm.errors import CloverError

BACKENDS = ("auto", "torch", "fla")
BACKEND = os.environ.get("CLOVER_GDN_BACKEND", "auto")
# fla's kernels are Triton programs for CUDA devices; tests widen this to run a stand-in on CPU.
DEVICES = ("cuda",)

_fla_function = None  # fla's chunk_gated_delta_rule once looked up; False when it cannot be used


def fla_chunk_function():
    """fla's chunk_gated_delta_rule, or None without CUDA or without fla (looked up once)."""
    global _fla_function
    if _fla_function is None:
        _fla_function = False
        if torch.cuda.is_available():
            try:
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            except Exception:  # a broken Triton or CUDA install must not stop the CPU path
                pass
            else:
                _fla_function = chunk_gated_delta_rule
    return _fla_function or None


def fla_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("flash-linear-attention", "fla-core"):  # newer releases ship the kernels in fla-core
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def kernel_for(x: torch.Tensor):
    """The fused kernel for tensors like `x` as kernel(q, k, v, log_decay, beta, initial_state) ->
    (o, final_state), or None: then the caller runs the pure-PyTorch reference."""
    if BACKEND not in BACKENDS:
        raise CloverError(f"CLOVER_GDN_BACKEND={BACKEND!r} is not one of {', '.join(BACKENDS)}")
    if BACKEND == "torch":
        return None
    function = fla_chunk_function() if x.device.type in DEVICES else None
    if function is None:
        if BACKEND == "fla":
            raise CloverError(
                "CLOVER_GDN_BACKEND=fla needs CUDA tensors and flash-linear-attention (pip install -e '.[cuda]')"
            )
        return None
    return partial(fla_gated_delta_rule, function)


def fla_gated_delta_rule(function, q, k, v, log_decay, beta, initial_state=None):
    """One fused causal pass over [B, T, H, D] inputs; returns (o in v's dtype, fp32 final state)."""
    # The kernels want q, k, v in one dtype; g stays fp32 (decays compound over thousands of tokens),
    # beta follows q as in transformers' Qwen3-Next call into fla.
    dtype = v.dtype
    o, state = function(
        q.to(dtype).contiguous(),
        k.to(dtype).contiguous(),
        v.contiguous(),
        g=log_decay.float().contiguous(),
        beta=beta.to(dtype).contiguous(),
        # Our q, k are already unit vectors (the in-block attention needs them normalised too), and
        # fla's default scale is the same 1/sqrt(Dk): given explicitly so a changed default cannot bite.
        scale=q.shape[-1] ** -0.5,
        initial_state=None if initial_state is None else initial_state.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    return o.to(dtype), state.float()
