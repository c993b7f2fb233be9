"""A CPU conversion run in chunks, each in a fresh process (training/conversion/chunks.py), is the run in
one piece: the same losses step for step and the same adapter."""

import json
import time

import pytest
from safetensors.torch import load_file

from cloverlm.errors import CloverError
from cloverlm.training.conversion import chunks
from cloverlm.training.conversion.chunks import checkpoint_step, train_in_chunks
from cloverlm.training.conversion.trainer import ConvertConfig, ConvertTrainer

# eval_every 0: the held-out pass at the schedule's end (20-message prompts) would cost more than the steps
SMALL = {"mixture": {"arithmetic": 1.0}, "tokens_per_step": 120, "eval_every": 0, "checkpoint_every": 1,
         "device": "cpu", "max_steps": 3}  # fmt: skip


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
def test_a_run_in_chunks_is_the_run_in_one_piece(tmp_path):
    # warm-started, as the campaign's runs are (a new adapter's A is drawn from each process's own RNG)
    ConvertTrainer(ConvertConfig(out=str(tmp_path / "parent"), **(SMALL | {"max_steps": 1}))).run()
    small = SMALL | {"init_adapter": str(tmp_path / "parent" / "adapter")}
    whole = ConvertTrainer(ConvertConfig(out=str(tmp_path / "whole"), **small)).run()
    chunked = train_in_chunks(ConvertConfig(out=str(tmp_path / "chunks"), **small), chunk_steps=2)
    assert chunked["step"] == whole["step"] == 3 and chunked["total_tokens"] == whole["total_tokens"]
    assert losses(tmp_path / "chunks") == losses(tmp_path / "whole") and len(losses(tmp_path / "whole")) == 3
    a, b = (load_file(str(tmp_path / name / "checkpoint" / "adapter_model.safetensors")) for name in ("whole", "chunks"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # stop_at below max_steps: the peer trains to Clover's step
    assert train_in_chunks(ConvertConfig(out=str(tmp_path / "peer"), **small), stop_at=1)["step"] == 1
    assert checkpoint_step(tmp_path / "peer") == 1 and checkpoint_step(tmp_path / "none") == 0


def test_a_chunk_that_fails_is_an_error_that_says_so(tmp_path):
    with pytest.raises(CloverError, match=r"a training chunk of .*bad \(to step 3\) failed with exit code 1"):
        train_in_chunks(ConvertConfig(out=str(tmp_path / "bad"), objective="nonsense", **SMALL))
    with pytest.raises(CloverError, match="needs max_steps"):
        train_in_chunks(ConvertConfig(out=str(tmp_path / "x"), **(SMALL | {"max_steps": None})))


def test_no_chunk_starts_once_the_minutes_are_spent(tmp_path, monkeypatch):
    """A chunk that ends on the deadline ends the run: no new process only to find no time left."""
    calls = []

    def chunk(cfg, minutes, stop_at):
        calls.append((minutes, stop_at))
        time.sleep(0.05)  # past the 0.0005-minute deadline
        return {"step": stop_at if minutes else 0}  # a child given no minutes trains no step

    monkeypatch.setattr(chunks, "_run_chunk", chunk)
    cfg = ConvertConfig(out=str(tmp_path / "run"), **(SMALL | {"max_steps": 30}))
    cfg.minutes = 0.0005
    assert train_in_chunks(cfg, chunk_steps=10) == {"step": 10} and [stop for _, stop in calls] == [10]
