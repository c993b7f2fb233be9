"""Building blocks shared by both layer kinds: RMS norms, rotary positions, the dense MLP and the sparse MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cloverlm.model.config import CloverConfig
from cloverlm.ops.moe import dispatch_experts


class CloverRMSNorm(nn.Module):
    """RMSNorm scaled by weight, or by (1 + weight) when zero_centered (config.rms_norm_zero_centered)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps

    @classmethod
    def of(cls, config: CloverConfig, dim: int) -> CloverRMSNorm:
        """The layer, final and q/k norms: the config's epsilon and centring."""
        return cls(dim, eps=config.rms_norm_eps, zero_centered=config.rms_norm_zero_centered)

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = 1.0 + self.weight.float() if self.zero_centered else self.weight
        return (weight * x).to(dtype)


class CloverGatedRMSNorm(CloverRMSNorm):
    """Per-head RMSNorm times SiLU of a gate: Qwen3.5's output normalisation for linear attention."""

    def forward(self, x, gate):
        return super().forward(x) * F.silu(gate.float()).to(x.dtype)


def rotary(x, positions, theta: float, rotary_dim: int | None = None):
    """Rotate pairs (i, i + D/2) of x [B, T, H, D] by angles positions * theta^(-2i/D).

    positions: [T] (shared by the batch) or [B, T] (rows at different offsets, as in batched decoding).
    rotary_dim < D: only the first rotary_dim dims are rotated (D := rotary_dim above), the rest pass.
    """
    dim = x.shape[-1]
    if rotary_dim is not None and rotary_dim < dim:
        return torch.cat([rotary(x[..., :rotary_dim], positions, theta), x[..., rotary_dim:]], dim=-1)
    inv_freq = theta ** -(torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv_freq
    if angles.dim() == 2:
        angles = angles[None]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


class CloverMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CloverExperts(nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class CloverSparseMoeBlock(nn.Module):
    """Softmax top-k routing with renormalised weights, plus a shared expert behind a sigmoid gate.

    Balancing: `expert_bias` (DeepSeek-V3's auxiliary-loss-free bias) shifts which experts are chosen
    but never the gate weights; it is nudged towards uniform load after each optimiser step by
    `update_bias`. A small Switch-style auxiliary loss is returned as well.
    """

    use_grouped_mm: bool | None = None  # None: grouped_mm where torch has it, else the loop
    # Data-parallel training sets this to a sum over ranks (distributed.wrap): the balancing loss and
    # the bias update then see the whole batch's load, exactly as one process would, on every rank.
    reduce_load = None

    def __init__(self, config: CloverConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = CloverExperts(config)
        self.shared_expert = CloverMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts), persistent=True)
        self.register_buffer("expert_load", torch.zeros(config.num_experts), persistent=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x).float(), dim=-1)
        _, expert_ids = torch.topk(probs + self.expert_bias, self.top_k, dim=-1)
        weights = probs.gather(-1, expert_ids)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = dispatch_experts(
            x, expert_ids, weights, self.experts.gate_up_proj, self.experts.down_proj,
            use_grouped_mm=self.use_grouped_mm,
        )
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        aux_loss = x.new_zeros((), dtype=torch.float32)
        if self.training:
            counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).float()
            if self.reduce_load is not None:
                self.reduce_load(counts)
            self.expert_load += counts.detach()
            fraction = counts / counts.sum()
            aux_loss = self.num_experts * (fraction * probs.mean(0)).sum()
        return (routed.to(shared.dtype) + shared).reshape(shape), aux_loss

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        if self.expert_load.sum() > 0:
            self.expert_bias += rate * torch.sign(self.expert_load.mean() - self.expert_load)
        self.expert_load.zero_()
