"""Checkpoints as safetensors + JSON, never pickles, written atomically.

A model folder holds config.json, model.safetensors, the tokenizer files and chat_template.jinja
(transformers' layout). A training checkpoint adds optimizer.safetensors and train_state.json.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel

from cloverlm.errors import CloverError
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.config import CloverConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
WEIGHTS = "model.safetensors"


def _check_safetensors(path: Path) -> None:
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
            if keys:  # reading one tensor catches a file cut short after a valid header
                handle.get_tensor(keys[-1])
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CloverError(f"{path} is corrupt or truncated ({str(error).splitlines()[0][:120]})") from None


def _leading_bytes(path: Path) -> bytes:
    with open(path, "rb") as handle:  # two bytes, not the whole (possibly multi-GB) file
        return handle.read(2)


def _reject_pickle(path: Path) -> None:
    if path.suffix in PICKLE_SUFFIXES or (path.is_file() and _leading_bytes(path) in (b"\x80\x02", b"\x80\x04", b"\x80\x05", b"PK")):
        raise CloverError(f"{path} looks like a pickle/torch.save file; cloverlm only loads safetensors + JSON checkpoints")


def checked_weights(path: str | Path) -> Path:
    """The model.safetensors of a model folder, after a one-line CloverError for every way it can be wrong."""
    path = Path(path)
    if path.is_file():
        _reject_pickle(path)
        raise CloverError(f"{path} is a file; pass the model folder (config.json + {WEIGHTS})")
    if not path.is_dir():
        raise CloverError(f"no model at {path}: the folder does not exist")
    weights = path / WEIGHTS
    if not weights.exists():
        pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = f" (found {pickles}: pickle checkpoints are refused)" if pickles else ""
        raise CloverError(f"no {WEIGHTS} in {path}{hint}")
    _check_safetensors(weights)
    return weights


def _unreadable_config(path, error: Exception) -> CloverError:
    return CloverError(f"unreadable config.json in {path}: {str(error).splitlines()[0][:120]}")


def stored_model_type(path: str | Path) -> str:
    """The model_type in a model folder's config.json ("clover" or the peer's "qwen3_5_moe_text")."""
    try:
        stored = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise _unreadable_config(path, error) from None
    return stored.get("model_type", "") if isinstance(stored, dict) else ""


def read_config(config_class: type[PretrainedConfig], path: str | Path) -> PretrainedConfig:
    """The folder's config, refusing a folder of another model type (transformers would only warn)."""
    found = stored_model_type(path)
    if found != config_class.model_type:
        raise CloverError(f"{path} holds a '{found}' model, not a '{config_class.model_type}' one")
    try:
        return config_class.from_pretrained(path)
    except (OSError, json.JSONDecodeError) as error:
        raise _unreadable_config(path, error) from None


def load_weights(model: PreTrainedModel, weights: Path) -> None:
    """Fill `model` from a checked safetensors file; a tied lm_head is stored once, as the embedding."""
    tied = model.config.tie_word_embeddings
    state = load_file(str(weights))
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise CloverError(
            f"{weights} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.tie_weights()


def multiplies_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether the hardware multiplies bf16 natively (CUDA, CPUs with AVX512-BF16 or AMX): the one rule
    behind both the dtype decoding runs in and training's autocast. On an AVX2-only CPU bf16 matmuls are
    emulated: a 16-token forward of the 135M model took 324 ms in bf16 against 130 ms in fp32, and a
    training step 4x as long (models/README.md)."""
    if torch.device(device).type == "cuda":
        return True
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def inference_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to decode in: bf16 where the hardware multiplies it natively, else fp32."""
    return torch.bfloat16 if multiplies_bf16(device) else torch.float32


def load_plain(path: str | Path, dtype: torch.dtype | None = torch.float32) -> CloverForBlockDiffusion:
    """A folder of Clover weights (model.safetensors + config.json), with one-line errors for every way it
    can be wrong. Folders holding a conversion adapter load with cloverlm.convert.load.load_model."""
    weights = checked_weights(path)
    model = CloverForBlockDiffusion(read_config(CloverConfig, path))
    load_weights(model, weights)
    return model.to(dtype).eval() if dtype is not None else model.eval()


def _fsync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def atomic_write_dir(target: Path, write) -> None:
    """Call write(tmp_dir), fsync, then swap it in: a crash leaves the old or the new folder, never half."""
    tmp = fresh_tmp_dir(target)
    write(tmp)
    swap_in(tmp, target)


def tmp_dir(target: Path) -> Path:
    """Where a new version of `target` is written before `swap_in`."""
    target = Path(target)
    return target.with_name(target.name + ".tmp")


def fresh_tmp_dir(target: Path) -> Path:
    """`tmp_dir(target)`, emptied and created."""
    tmp = tmp_dir(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_in(tmp: Path, target: Path) -> None:
    """fsync `tmp`, then make it `target`; `recover_dir` finds `target.old` if a crash comes in between."""
    target = Path(target)
    old = target.with_name(target.name + ".old")
    _fsync_tree(tmp)
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(target: Path) -> Path | None:
    """The last complete checkpoint: `target`, or `target.old` if a crash came mid-swap."""
    target = Path(target)
    for candidate in (target, target.with_name(target.name + ".old")):
        if (candidate / "train_state.json").exists():
            return candidate
    return None


def save_model(model: PreTrainedModel, tokenizer, folder: Path, dtype: torch.dtype | None = None) -> None:
    """config.json + model.safetensors (+ tokenizer files and chat_template.jinja), for Clover or its peer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Flatten an optimizer state_dict into safetensors-able tensors plus a JSON-able remainder."""
    state = optimizer.state_dict()
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}
    for index, entry in state["state"].items():
        meta["state"][str(index)] = {}
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.contiguous()
            else:
                meta["state"][str(index)][name] = value
    return tensors, meta


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {int(i): dict(v) for i, v in meta["state"].items()}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def load_optimizer_file(path: Path) -> dict[str, torch.Tensor]:
    _check_safetensors(path)
    return load_file(str(path))
