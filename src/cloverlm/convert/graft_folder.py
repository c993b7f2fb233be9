"""A grafted model on disk as its teacher plus the trained mixers of its memory layers (issue 30): the form in
which a hybrid ships (models/smollm2-clover-hybrid) and in which a graft's training outlives the machine it
ran on.

A graft's stages train only its memory layers' mixers (training/graft/base.py); every other weight is its
teacher's. So the folder holds clover_graft.json (the teacher's folder, relative to this one, and a digest of
the weights file it loads; the memory layers; the training runs that made the mixers) and the mixers in fp16,
in parts of at most MAX_PART_BYTES (the repository's rule is under 30 MB a file). The mixers of the 22 memory
layers of SmolLM2-135M are 37M parameters: 148 MB in fp32, 74 MB in fp16. fp16 rather than the conversion
adapter's bf16: these are whole weights, not a small delta, and fp16 keeps three more bits of each.

Loading (convert/load.py) grafts the teacher's listed layers without calibration, then puts the stored
mixers in place: every key of every memory layer's mixer must be in the folder, and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cloverlm.convert.adapter import is_adapter_folder
from cloverlm.convert.graft import graft_memory, grafted_layers
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import WEIGHTS, atomic_write_dir
from cloverlm.model.clover import CloverForBlockDiffusion

GRAFT_META = "clover_graft.json"
MAX_PART_BYTES = 25 * 2**20
STORED_DTYPE = torch.float16


def is_graft_folder(folder) -> bool:
    return (Path(folder) / GRAFT_META).is_file()


def graft_meta(folder) -> dict:
    return json.loads((Path(folder) / GRAFT_META).read_text())


def recorded_runs(folder) -> dict[str, dict]:
    """The training runs clover_graft.json records (state, config, device), by recipe; {} for a folder that
    is not a graft folder."""
    return graft_meta(folder)["runs"] if is_graft_folder(folder) else {}


def trained_runs(folder) -> dict[str, dict] | None:
    """What the runs recorded in `folder` had done, by recipe (step, max_steps, tokens); None where it
    records none (e.g. a plain model folder)."""
    return {recipe: run["state"] for recipe, run in recorded_runs(folder).items()} or None


def teacher_folder(folder) -> Path:
    """The teacher's folder: clover_graft.json names it relative to the graft folder."""
    return Path(os.path.normpath(Path(folder) / graft_meta(folder)["teacher"]))


def teacher_digest(teacher) -> str:
    """sha256 of the weights file that loading `teacher` reads (its adapter, or its plain weights)."""
    name = "adapter_model.safetensors" if is_adapter_folder(teacher) else WEIGHTS
    digest = hashlib.sha256()
    with open(Path(teacher) / name, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _mixer_prefix(layer: int) -> str:
    return f"model.layers.{layer}.linear_attn."


def save_graft_folder(
    student: CloverForBlockDiffusion, teacher: CloverForBlockDiffusion, teacher_path, folder, runs: dict,
    files: dict[str, bytes] | None = None,
) -> None:
    """Write `folder` (replaced atomically): `student`'s grafted mixers over `teacher` (loaded from
    `teacher_path`), with `runs` (the training runs that made them, by recipe) in clover_graft.json and
    `files` (name: contents, e.g. the runs' logs) beside them. CloverError when the student is not a graft
    of the teacher or a mixer weight does not fit fp16."""
    layers = grafted_layers(teacher, student)
    state = student.state_dict()
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for layer in layers:
        mixer = {k: v.detach() for k, v in state.items() if k.startswith(_mixer_prefix(layer))}
        for key, value in mixer.items():
            if not torch.isfinite(value).all() or value.abs().max() > torch.finfo(STORED_DTYPE).max:
                raise CloverError(f"{key} has values that fp16 cannot hold (non-finite or above 65504)")
        layer_bytes = sum(v.numel() for v in mixer.values()) * STORED_DTYPE.itemsize
        if parts[-1] and size + layer_bytes > MAX_PART_BYTES:  # a layer's mixer stays in one part
            parts.append({})
            size = 0
        parts[-1].update({k: v.to(STORED_DTYPE).contiguous() for k, v in mixer.items()})
        size += layer_bytes
    names = [f"mixers-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]

    def write(tmp: Path) -> None:
        for name, part in zip(names, parts):
            save_file(part, str(tmp / name), metadata={"format": "pt"})
        meta = {
            "teacher": os.path.relpath(Path(teacher_path).resolve(), Path(folder).resolve()),
            "teacher_sha256": teacher_digest(teacher_path),
            "memory_layers": layers,
            "dtype": str(STORED_DTYPE).removeprefix("torch."),
            "parts": names,
            "runs": runs,
            "files": sorted(files or {}),
        }
        (tmp / GRAFT_META).write_text(json.dumps(meta, indent=1) + "\n")
        for name, contents in (files or {}).items():
            (tmp / name).write_bytes(contents)

    atomic_write_dir(Path(folder), write)


def grafted_from(teacher: CloverForBlockDiffusion, folder, dtype: torch.dtype) -> CloverForBlockDiffusion:
    """The hybrid of graft folder `folder` on `teacher` (loaded from the folder's teacher_folder), in `dtype`."""
    folder = Path(folder)
    meta = graft_meta(folder)
    teacher_path = teacher_folder(folder)
    if teacher_digest(teacher_path) != meta["teacher_sha256"]:
        raise CloverError(f"{folder} was trained on other weights than {teacher_path} holds now: "
                          "graft and train it again from this teacher (scripts/graft.sh)")  # fmt: skip
    stored: dict[str, torch.Tensor] = {}
    for name in meta["parts"]:
        path = folder / name
        if not path.is_file():
            raise CloverError(f"{path} is missing: the graft folder is incomplete")
        stored.update(load_file(str(path)))
    model = graft_memory(teacher, meta["memory_layers"])
    expected = {k for k in model.state_dict() if k.startswith(tuple(map(_mixer_prefix, meta["memory_layers"])))}
    missing, unexpected = sorted(expected - stored.keys()), sorted(stored.keys() - expected)
    if missing or unexpected:
        raise CloverError(f"{folder}'s mixers do not fit its memory layers: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.load_state_dict({k: v.float() for k, v in stored.items()}, strict=False)
    return model.to(dtype).eval()
