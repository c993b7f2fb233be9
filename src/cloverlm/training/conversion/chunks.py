"""A CPU conversion run in chunks of steps, each in a fresh process (the campaign's trainer on the CPU).

glibc's heap fragments as a CPU training process ages, and malloc gets slower with it: in one campaign
process malloc's share of the CPU (perf) grew from 9.5% at its first steps to 25% forty-five steps later,
and the steps' tokens per second fell from 217 in a fresh process's first ten steps to 142-155 by its
third ten (models/README.md, the campaign of 2026-12-07). A fresh process starts with a fresh heap. The
trainer resumes exactly from its checkpoint (same batches, same optimizer state), so a run in chunks is
the run in one piece, step for step; what a chunk costs is the new process's start (imports, the model
and the checkpoint) and its end (the held-out loss and the adapter written).

The child reads its orders as JSON on stdin and writes the trainer's summary as JSON to a file: nothing
crosses the process boundary as a pickle.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import recover_dir
from cloverlm.training.conversion.config import ConvertConfig
from cloverlm.training.conversion.trainer import ConvertTrainer
from cloverlm.training.loop import STATE_FILE

CHUNK_STEPS = 10  # steps a process trains: the fall came within a fresh process's second ten steps
SUMMARY_FILE = "chunk_summary.json"  # in the run's folder: the last chunk's summary


def checkpoint_step(out: str | Path) -> int:
    """Steps done by the run in `out` (0 when it has not begun)."""
    folder = recover_dir(Path(out) / "checkpoint")
    return json.loads((folder / STATE_FILE).read_text())["state"]["step"] if folder else 0


def train_in_chunks(cfg: ConvertConfig, stop_at: int | None = None, chunk_steps: int = CHUNK_STEPS) -> dict:
    """Train `cfg`'s run to `stop_at` steps (or its max_steps), within cfg.minutes of wall time when given,
    `chunk_steps` at a time, each chunk in a new process. Returns the trainer's summary of the last one."""
    if cfg.max_steps is None:
        raise CloverError("training in chunks needs max_steps: a --minutes budget alone is calibrated per process")
    deadline = None if cfg.minutes is None else time.time() + 60 * cfg.minutes
    end = cfg.max_steps if stop_at is None else min(stop_at, cfg.max_steps)
    summary = None
    while True:
        target = min(checkpoint_step(cfg.out) + chunk_steps, end)
        minutes = None if deadline is None else max(deadline - time.time(), 0.0) / 60
        if summary is not None and minutes == 0:  # the minutes ran out at a chunk's end: no process for nothing
            return summary
        summary = _run_chunk(cfg, minutes, target)
        if summary["step"] >= end or summary["step"] < target:  # done, or out of minutes
            return summary


def _run_chunk(cfg: ConvertConfig, minutes: float | None, stop_at: int) -> dict:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    summary_path = Path(cfg.out) / SUMMARY_FILE
    summary_path.unlink(missing_ok=True)
    orders = {"config": asdict(cfg) | {"minutes": minutes}, "stop_at": stop_at, "summary": str(summary_path),
              "threads": torch.get_num_threads()}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(orders), text=True)
    if done.returncode != 0 or not summary_path.is_file():
        raise CloverError(f"a training chunk of {cfg.out} (to step {stop_at}) failed with exit code {done.returncode}")
    return json.loads(summary_path.read_text())


def train_here(cfg: ConvertConfig, stop_at: int | None = None) -> dict:
    """`cfg`'s run in this process: resumed if it has begun, trained to `stop_at` steps (or its end);
    the trainer's summary. A chunk's child, and the campaign's trainer on CUDA."""
    trainer = ConvertTrainer(cfg, resume=recover_dir(Path(cfg.out) / "checkpoint") is not None)
    try:
        return trainer.run(stop_at=stop_at) if stop_at is None or trainer.step < stop_at else trainer.finish(None)
    finally:
        del trainer
        gc.collect()  # the next trainer's memory: release_heap hands this one's back to the kernel


def _chunk(orders: dict) -> None:
    """One chunk, in this (new) process."""
    torch.set_num_threads(orders["threads"])
    summary = train_here(ConvertConfig(**orders["config"]), orders["stop_at"])
    Path(orders["summary"]).write_text(json.dumps(summary))


if __name__ == "__main__":
    _chunk(json.loads(sys.stdin.read()))
