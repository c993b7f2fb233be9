"""Export a training run's checkpoint (Clover or the peer) as a shipped model: bf16 weights,
tokenizer, training log."""

import shutil
import sys
from pathlib import Path

import torch

from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.convert.peer import is_peer_folder, load_peer, save_peer
from cloverlm.model.checkpoint import save_model


def main(run: str, out: str) -> None:
    checkpoint = Path(run) / "checkpoint"
    tokenizer = load_folder_tokenizer(checkpoint)
    if is_peer_folder(checkpoint):
        save_peer(load_peer(checkpoint), tokenizer, Path(out), dtype=torch.bfloat16)
    else:
        save_model(load_model(checkpoint), tokenizer, Path(out), dtype=torch.bfloat16)
    shutil.copy(Path(run) / "train_log.jsonl", Path(out) / "train_log.jsonl")
    size = (Path(out) / "model.safetensors").stat().st_size
    print(f"{out}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:])
