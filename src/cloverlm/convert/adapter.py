"""The conversion adapter on disk: a peft LoRA adapter on every linear layer of the converted base (plus,
for Clover, the mask token's embedding row), written by `clover train --recipe convert`
(cloverlm.training.conversion.trainer) and merged into its base when a folder is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cloverlm.convert.base import base_tokenizer, converted, load_base
from cloverlm.errors import CloverError
from cloverlm.tokenizer import same_tokenizer

LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_META = "clover_adapter.json"


def with_adapter(model, objective: str, rank: int, alpha: int):
    """The model wrapped in a fresh peft LoRA adapter on every linear layer."""
    from peft import LoraConfig, get_peft_model

    # Clover also learns the mask token's embedding row; the peer never reads a mask.
    tokens = {"embed_tokens": [model.config.mask_token_id]} if objective == "diffusion" else None
    lora = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=LINEAR_MODULES,
        trainable_token_indices=tokens,
    )
    return get_peft_model(model, lora)


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def save_adapter(peft_model, tokenizer, folder: Path, meta: dict, dtype=torch.float32) -> None:
    """adapter_model.safetensors + adapter_config.json (peft's format) + clover_adapter.json. The tokenizer
    is written only when it is not the base's (`base_tokenizer`), which the folder's loader rebuilds
    (`cloverlm.convert.load.load_folder_tokenizer`): a copy of the base's is 3.5 MB a folder."""
    folder.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config["default"].save_pretrained(str(folder))
    state = {k: v.to(dtype) for k, v in adapter_state(peft_model).items()}
    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / ADAPTER_META).write_text(json.dumps(meta, indent=1) + "\n")
    if not same_tokenizer(tokenizer, base_tokenizer(meta["base"])):
        tokenizer.save_pretrained(folder)


def is_adapter_folder(folder) -> bool:
    return (Path(folder) / ADAPTER_META).is_file()


def adapter_meta(folder) -> dict:
    """clover_adapter.json: the base, objective, rank and lineage."""
    return json.loads((Path(folder) / ADAPTER_META).read_text())


def adapter_objective(folder) -> str | None:
    """"diffusion" (a Clover adapter), "ar" (the peer's), or None for a folder without an adapter."""
    if not is_adapter_folder(folder):
        return None
    return adapter_meta(folder).get("objective", "diffusion")


def load_adapted(folder, dtype=torch.float32):
    """Base + adapter, merged: an ordinary CloverForBlockDiffusion, or for the peer's adapter the base's
    transformers causal LM (and the tokenizer)."""
    from peft import set_peft_model_state_dict

    folder = Path(folder)
    meta = adapter_meta(folder)
    objective = meta.get("objective", "diffusion")
    model, tokenizer = converted(meta["base"]) if objective == "diffusion" else load_base(meta["base"])
    peft_model = with_adapter(model, objective, meta["lora_rank"], meta["lora_alpha"])
    weights = load_file(str(folder / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(peft_model, {k: v.float() for k, v in weights.items()})
    if getattr(result, "unexpected_keys", None):
        raise CloverError(f"adapter in {folder} does not fit the base: unexpected {result.unexpected_keys[:3]}")
    merged = peft_model.merge_and_unload()
    return merged.to(dtype).eval(), tokenizer
