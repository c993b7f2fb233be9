"""Routed-expert dispatch: tokens sorted by expert, then one grouped matmul per projection.

Both paths compute, for each (token, expert) assignment, down(silu(gate(x)) * up(x)) with the
expert's weights laid out as in Qwen3.5-MoE: gate_up_proj [E, 2I, H] and down_proj [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm")


def dispatch_experts(x, expert_ids, weights, gate_up_proj, down_proj, *, use_grouped_mm: bool | None = None):
    """x [N, H]; expert_ids, weights [N, K]. Returns sum_k weights[:, k] * expert_{ids[:, k]}(x) [N, H]."""
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_available()
    num_tokens, top_k = expert_ids.shape
    num_experts = gate_up_proj.shape[0]
    flat_experts = expert_ids.reshape(-1)
    order = flat_experts.argsort(stable=True)
    token_of = order // top_k
    sorted_x = x[token_of]
    counts = torch.bincount(flat_experts, minlength=num_experts)
    if use_grouped_mm:
        ends = counts.cumsum(0).to(torch.int32)
        # grouped_mm wants one dtype for both operands and autocast does not cover it: cast by hand.
        device = sorted_x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else sorted_x.dtype
        gate_up = F.grouped_mm(sorted_x.to(dtype), gate_up_proj.to(dtype).transpose(-2, -1), offs=ends)
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, down_proj.to(dtype).transpose(-2, -1), offs=ends)
    else:
        out = sorted_x.new_empty(sorted_x.shape[0], down_proj.shape[1])
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                rows = sorted_x[start : start + count]
                gate, up = F.linear(rows, gate_up_proj[expert]).chunk(2, dim=-1)
                out[start : start + count] = F.linear(F.silu(gate) * up, down_proj[expert])
            start += count
    weighted = out * weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(x, dtype=out.dtype).index_add_(0, token_of, weighted)
