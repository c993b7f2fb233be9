"""scripts/graft.sh all: the one command that builds a hybrid (issue 30, "done when"): the all-memory graft,
stage 1, the layer selection and stage 2 in turn, each resumed or skipped when done, on a tiny converted Llama.
scripts/graft.sh continue: a published hybrid carried through both stages from one machine to the next."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from cloverlm.convert.base import base_tokenizer
from cloverlm.convert.graft import graft_memory
from cloverlm.convert.graft_folder import graft_meta
from cloverlm.convert.load import load_model
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY
from test_graft import converted_llama

ROOT = Path(__file__).resolve().parents[1]
SELECT_OPTIONS = ["--tokens", "64", "--seq-len", "32", "--kv-prompts", "1", "--needle-context", "none", "--fp32"]


def graft_sh(*args: str, expect: int = 0, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "scripts/graft.sh", *args], cwd=ROOT, env={**os.environ, "FOREGROUND": "1", **env},
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if "a training is already running" in done.stderr:  # the script's own rule: one training on the machine
        pytest.skip("a training runs on this machine: graft.sh refuses to start beside it")
    assert done.returncode == expect, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def graft_all(runs: Path, teacher: Path) -> subprocess.CompletedProcess:
    return graft_sh("all", "10", *SELECT_OPTIONS, RUNS=str(runs), TEACHER=str(teacher), KEEP="1", STAGE1_STEPS="2",
                    STAGE2_STEPS="2")  # fmt: skip


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


@pytest.mark.slow
def test_graft_continue_carries_a_published_hybrid_through_both_stages_from_machine_to_machine(tmp_path):
    """Stage 1 publishes the hybrid on one machine; on the next (no runs folder, a longer schedule) `continue`
    takes stage 1 up from the folder's record, then runs stage 2, publishing both; a third call has nothing to do."""
    tokenizer = base_tokenizer()
    teacher = converted_llama(vocab_size=len(tokenizer), layers=4)
    save_model(teacher, tokenizer, tmp_path / "teacher")
    save_model(graft_memory(teacher, [0, 2, 3]), tokenizer, tmp_path / "graft")
    hybrid, common = tmp_path / "hybrid", {"TEACHER": str(tmp_path / "teacher"), "STAGE2_STEPS": "2"}
    missing = graft_sh("continue", "10", expect=2, RUNS=str(tmp_path / "none"), HYBRID=str(hybrid), **common)
    assert f"no graft folder at {hybrid}" in missing.stderr
    graft_sh("1", "10", RUNS=str(tmp_path / "first"), STUDENT=str(tmp_path / "graft"), PUBLISH=str(hybrid),
             STAGE1_STEPS="2", **common)  # fmt: skip
    assert graft_meta(hybrid)["runs"]["graft-stage1"]["state"]["step"] == 2

    second = {"RUNS": str(tmp_path / "second"), "HYBRID": str(hybrid), "STAGE1_STEPS": "3", **common}
    done = graft_sh("continue", "10", **second)
    assert f"the hybrid's stages are done: {hybrid}" in done.stdout
    runs = graft_meta(hybrid)["runs"]
    assert (runs["graft-stage1"]["state"]["step"], runs["graft-stage2"]["state"]["step"]) == (3, 2)
    log = [json.loads(line) for line in (tmp_path / "second" / "hybrid-stage1" / "train_log.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in log if "event" not in r] == [1, 2, 3]  # the first machine's two steps, and one
    assert [r["event"] for r in log if "event" in r] == ["continued from a graft folder"]
    files = {path.name: path.read_bytes() for path in hybrid.iterdir()}
    again = graft_sh("continue", "10", **second)
    assert f"the hybrid's stages are done: {hybrid}" in again.stdout
    assert files == {path.name: path.read_bytes() for path in hybrid.iterdir()}
