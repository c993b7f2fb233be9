"""Export a training run's checkpoint as a shipped model: bf16 weights, tokenizer, training log."""

import shutil
import sys
from pathlib import Path

import torch

from cloverlm.checkpoint import load_model, save_model
from cloverlm.tokenizer import load_tokenizer


def main(run: str, out: str) -> None:
    checkpoint = Path(run) / "checkpoint"
    model = load_model(checkpoint)
    save_model(model, load_tokenizer(checkpoint), Path(out), dtype=torch.bfloat16)
    shutil.copy(Path(run) / "train_log.jsonl", Path(out) / "train_log.jsonl")
    size = (Path(out) / "model.safetensors").stat().st_size
    print(f"{out}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:])
