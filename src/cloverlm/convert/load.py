"""Loading a model folder, whatever it holds: Clover weights, a conversion adapter over its base, or a
graft's mixers over its teacher (convert/graft_folder.py); and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from cloverlm.convert.adapter import adapter_meta, adapter_objective, is_adapter_folder, load_adapted
from cloverlm.convert.base import base_tokenizer
from cloverlm.convert.graft_folder import grafted_from, is_graft_folder, teacher_folder
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import load_plain
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.tokenizer import load_tokenizer

TOKENIZER_FILE = "tokenizer.json"


def load_model(path: str | Path, dtype: torch.dtype | None = torch.float32) -> CloverForBlockDiffusion:
    """Load a Clover folder with one-line errors for every way it can be wrong. A folder holding a
    conversion adapter (clover_adapter.json) is its base plus the adapter, merged; a graft folder
    (clover_graft.json) is its teacher with the stored memory layers."""
    if is_graft_folder(path):
        return grafted_from(load_model(teacher_folder(path)), path, dtype or torch.float32)
    objective = adapter_objective(path)
    if objective is None:
        return load_plain(path, dtype)
    if objective != "diffusion":
        raise CloverError(f"{path} holds the autoregressive peer's adapter, not a Clover model")
    return load_adapted(path, dtype or torch.float32)[0]


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `load_folder_tokenizer` finds a tokenizer for the folder."""
    return is_adapter_folder(folder) or is_graft_folder(folder) or (Path(folder) / TOKENIZER_FILE).is_file()


def load_folder_tokenizer(path: str | Path):
    """The tokenizer of a model folder: the one saved in it, else for an adapter folder its base's, rebuilt
    by the code the trainer built it with (`base_tokenizer`; `save_adapter` writes none when it is that)."""
    path = Path(path)
    if is_graft_folder(path):
        return load_folder_tokenizer(teacher_folder(path))
    if is_adapter_folder(path) and not (path / TOKENIZER_FILE).is_file():
        return base_tokenizer(adapter_meta(path)["base"])
    return load_tokenizer(path)
