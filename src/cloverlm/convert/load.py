"""Loading a model folder, whatever it holds: Clover weights, or a conversion adapter over its base."""

from __future__ import annotations

from pathlib import Path

import torch

from cloverlm.convert.adapter import adapter_objective, load_adapted
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import load_plain
from cloverlm.model.clover import CloverForBlockDiffusion


def load_model(path: str | Path, dtype: torch.dtype | None = torch.float32) -> CloverForBlockDiffusion:
    """Load a Clover folder with one-line errors for every way it can be wrong. A folder holding a
    conversion adapter (clover_adapter.json) is its base plus the adapter, merged."""
    objective = adapter_objective(path)
    if objective is None:
        return load_plain(path, dtype)
    if objective != "diffusion":
        raise CloverError(f"{path} holds the autoregressive peer's adapter, not a Clover model")
    return load_adapted(path, dtype or torch.float32)[0]
