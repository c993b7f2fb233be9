"""The memory graft's GPU window (scripts/gpu_window/run_graft.py): what comes back is only the trained
mixers, and the student rebuilt from them here is the one trained there, on the teacher it learnt from."""

import argparse
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY
from test_graft_stage1 import grafted_folders

spec = importlib.util.spec_from_file_location("run_graft", Path(__file__).parents[1] / "scripts/gpu_window/run_graft.py")
run_graft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_graft)


@pytest.fixture(scope="module")
def window(tmp_path_factory):
    """(teacher, a "trained" student: its mixers moved off their grafted values, the mixers file, root)."""
    root = tmp_path_factory.mktemp("window")
    teacher, student = grafted_folders(root, [1, 2])
    model = load_model(student)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if run_graft.MIXER in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    save_model(model, load_folder_tokenizer(student), root / "trained")
    summary = run_graft.mixers(root / "trained", str(teacher), root / "mixers.safetensors")
    return teacher, root / "trained", summary, root


def test_only_the_mixers_come_back_and_the_rebuilt_student_is_the_trained_one(window):
    teacher, trained, summary, root = window
    assert summary["layers"] == [1, 2]
    rebuilt = load_model(run_graft.rebuild(str(teacher), root / "mixers.safetensors", root / "rebuilt")["out"]).state_dict()
    expected = load_model(trained).state_dict()
    assert set(rebuilt) == set(expected)
    assert sum(t.numel() for k, t in expected.items() if run_graft.MIXER in k) == summary["parameters"]
    for key, value in expected.items():
        assert torch.equal(rebuilt[key], value), key


def test_mixers_are_not_put_into_a_graft_of_another_teacher(window):
    teacher, _, _, root = window
    other = load_model(teacher)
    with torch.no_grad():
        other.model.embed_tokens.weight.add_(1.0)
    save_model(other, load_folder_tokenizer(teacher), root / "other_teacher")
    with pytest.raises(SystemExit, match="not the teacher these mixers learnt from"):
        run_graft.rebuild(str(root / "other_teacher"), root / "mixers.safetensors", root / "wrong")


def test_the_teacher_is_known_by_its_weights_not_by_its_block_size_head(window, tmp_path):
    """The window's payload carries a teacher without calibration.safetensors; the folder here has one."""
    teacher, _, _, root = window
    copy = tmp_path / "teacher"
    shutil.copytree(teacher, copy)
    (copy / "calibration.safetensors").write_bytes(b"a refitted head")
    assert run_graft.teacher_digest(copy) == run_graft.teacher_digest(teacher)
    assert run_graft.rebuild(str(copy), root / "mixers.safetensors", tmp_path / "rebuilt")["layers"] == [1, 2]


@pytest.mark.slow
def test_the_window_trains_stage_1_selects_and_trains_stage_2_as_the_cpu_pipeline(tmp_path):
    teacher, _ = grafted_folders(tmp_path, [0])
    args = argparse.Namespace(
        teacher=str(teacher), out=str(tmp_path / "window"), minutes=10.0, stage1_share=0.5, keep=1, memory_layers=None,
        stage1_tokens=2 * 2 * 32, stage2_tokens=2 * 2 * 2 * 32, stage2_data_weight=0.0, rows_per_step=2, seq_len=32,
        device="cpu")  # fmt: skip
    probes = {"tokens": 64, "seq_len": 32, "kv_prompts": 1, "needle_contexts": (), "bf16": False}
    summary = run_graft.train(args, probes)
    window = tmp_path / "window"
    assert load_model(window / "all-memory").config.layer_types == [MEMORY] * 4
    assert summary["stage1"]["steps"] == 2 and summary["stage1"]["layers"] == [0, 1, 2, 3]
    chosen = summary["select"]["chosen"]
    assert len(chosen) == 1 and summary["stage2"]["steps"] == 2
    kinds = load_model(window / "stage2" / "student").config.layer_types
    assert [i for i, kind in enumerate(kinds) if kind == ATTENTION] == chosen
    again = run_graft.train(args, probes)  # every step done: nothing is selected again, no stage takes a step
    assert "select" not in again and again["stage2"]["steps"] == 2
