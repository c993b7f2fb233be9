"""Data-parallel training under torchrun (CPU, gloo): the same steps as one process, sharded checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloverlm import CloverError
from cloverlm.convert.load import load_model
from cloverlm.training import distributed
from conftest import losses

ROOT = Path(__file__).resolve().parents[1]

# fp32: bf16 autocast would round the two runs' different summation orders to visibly different losses.
# seq-len 512 is the shortest the evaluation's probes fit; 3 steps cover both warm-up (next-token) and
# block-diffusion batches (the stage advances at step 2).
ARGS = [
    "--preset", "clover-tiny", "--max-steps", "3", "--seq-len", "512", "--batch-size", "4", "--fp32",
    "--eval-every", "100", "--probe-examples", "1", "--threads", "1", "--tokenizer", str(ROOT / "models/scratch-tokenizer"),
    "--set", "hidden_size=32", "--set", "num_experts=4", "--set", "moe_intermediate_size=16",
    "--set", "shared_expert_intermediate_size=32", "--set", "linear_key_head_dim=8",
    "--set", "linear_value_head_dim=8", "--set", "head_dim=8",
]  # fmt: skip
# --standalone: a free rendezvous port, so runs beside other torchrun jobs do not collide
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# Same fp32 math, summed in another order (each rank sums its rows; DDP averages gradients): about
# 1e-6 relative per step, seen equal to the logged 5 decimals over 3 Adam steps; 1e-4 leaves room.
REL = 1e-4


def train(*command, out: Path, env=None, timeout=600):
    result = subprocess.run(
        [*command, "-m", "cloverlm", "train", "--out", str(out), *ARGS], capture_output=True, text=True, env=env,
        timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_same_losses(run: Path, reference: Path):
    got, want = losses(run), losses(reference)
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=REL), (step, got, want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batch."""
    out = tmp_path_factory.mktemp("single") / "run"
    train(sys.executable, out=out)
    return out


@pytest.mark.slow
def test_two_processes_take_the_steps_of_one(tmp_path, reference):
    out = tmp_path / "ddp"
    result = train(*TORCHRUN, out=out)
    assert result.stdout.count('"steps": 3') == 1  # the summary comes from rank 0 only
    assert_same_losses(out, reference)
    checkpoint = out / "checkpoint"
    state = json.loads((checkpoint / "train_state.json").read_text())
    assert state["format"] == "dcp" and state["world_size"] == 2 and state["state"]["step"] == 3
    # one safetensors shard per rank, and no pickled DCP .metadata anywhere
    assert len(list((checkpoint / "shards").glob("*.safetensors"))) == 2
    assert not list(checkpoint.rglob("*.metadata")) and not list(checkpoint.rglob("*.distcp"))
    # the last checkpoint is also a model folder, as a single-process run's is
    mine, theirs = load_file(str(checkpoint / "model.safetensors")), load_file(str(reference / "checkpoint/model.safetensors"))
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-5, rtol=1e-4, msg=name)
    load_model(checkpoint)


def test_batch_must_split_evenly_across_processes(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert distributed.shard_rows(4) == slice(2, 4)
    with pytest.raises(CloverError, match="--batch-size 3 is not divisible by the 2 processes"):
        distributed.shard_rows(3)


def _process_tree(pid: int) -> list[int]:
    """pid and its descendants: torchrun starts its workers in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
def test_sharded_resume_after_sigkill_replays_the_same_losses(tmp_path, reference):
    """Killed under FSDP2 after two steps, resumed under DDP: DCP reshards, the steps replay exactly."""
    out = tmp_path / "killed"
    command = [*TORCHRUN, "-m", "cloverlm", "train", "--out", str(out), *ARGS, "--checkpoint-every", "1"]
    process = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, "CLOVER_PARALLEL": "fsdp"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and len(losses(out) if (out / "train_log.jsonl").exists() else {}) < 2:
        time.sleep(0.05)
    for pid in _process_tree(process.pid):
        os.kill(pid, signal.SIGKILL)
    process.wait()
    assert len(losses(out)) < 3, "the run finished before it could be killed"
    result = subprocess.run(
        [*command, "--resume"], cwd=ROOT, env={**os.environ, "CLOVER_PARALLEL": "ddp"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(out, reference)
    load_model(out / "checkpoint")
