"""scripts/graft.sh all: the one command that builds a hybrid (issue 30, "done when"): the all-memory graft,
stage 1, the layer selection and stage 2 in turn, each resumed or skipped when done, on a tiny converted Llama."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from cloverlm.convert.base import base_tokenizer
from cloverlm.convert.load import load_model
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY
from test_graft import converted_llama

ROOT = Path(__file__).resolve().parents[1]
SELECT_OPTIONS = ["--tokens", "64", "--seq-len", "32", "--kv-prompts", "1", "--needle-context", "none", "--fp32"]


def graft_all(runs: Path, teacher: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNS": str(runs), "TEACHER": str(teacher), "KEEP": "1", "STAGE1_STEPS": "2",
           "STAGE2_STEPS": "2", "FOREGROUND": "1"}  # fmt: skip
    done = subprocess.run(["bash", "scripts/graft.sh", "all", "10", *SELECT_OPTIONS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if "a training is already running" in done.stderr:  # the script's own rule: one training on the machine
        pytest.skip("a training runs on this machine: graft.sh refuses to start beside it")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.mark.slow
def test_graft_all_builds_the_hybrid_and_a_second_call_has_nothing_left_to_do(tmp_path):
    tokenizer = base_tokenizer()
    save_model(converted_llama(vocab_size=len(tokenizer), layers=4), tokenizer, tmp_path / "teacher")
    runs = tmp_path / "runs"
    done = graft_all(runs, tmp_path / "teacher")
    assert f"the hybrid: {runs}/graft-stage2/student" in done.stdout
    assert load_model(runs / "graft" / "all-memory").config.layer_types == [MEMORY] * 4
    stage1 = json.loads((runs / "graft-stage1" / "checkpoint" / "train_state.json").read_text())["state"]
    assert stage1["step"] == stage1["max_steps"] == 2
    report = json.loads((runs / "graft-select" / "graft_select.json").read_text())
    assert len(report["chosen"]) == 1 and report["student"] == f"{runs}/graft-stage1/student"
    hybrid = load_model(runs / "graft-stage2" / "student")
    assert hybrid.config.layer_types.count(ATTENTION) == 1
    assert hybrid.config.layer_types.index(ATTENTION) == report["chosen"][0]
    logs = {stage: (runs / stage / "train_log.jsonl").read_text() for stage in ("graft-stage1", "graft-stage2")}
    again = graft_all(runs, tmp_path / "teacher")  # every stage done: nothing trains again
    assert f"the hybrid: {runs}/graft-stage2/student" in again.stdout
    assert logs == {stage: (runs / stage / "train_log.jsonl").read_text() for stage in logs}
