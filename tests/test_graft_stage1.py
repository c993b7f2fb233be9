"""Stage 1 of the memory graft (issue 30, item 2; training/graft/stage1.py): each grafted memory layer fitted to
its teacher attention's output, on a tiny converted Llama with the packaged base's tokenizer."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloverlm.cli import main
from cloverlm.convert.base import base_tokenizer
from cloverlm.convert.graft import calibration_ids, graft_memory
from cloverlm.convert.load import load_model
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY
from cloverlm.training.graft.base import running_mean
from cloverlm.training.graft.stage1 import GraftStage1, Stage1Config
from test_graft import converted_llama
from test_training_loop import crash_at, logged

GRAFTED = [0, 1, 2]  # layer 3 stays attention
TEACHER_DIGEST = []  # the teacher's weights file as written, before any run


def digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(teacher, student) folders: a tiny converted Llama and its graft, with a tokenizer the mixture encodes."""
    teacher, student = grafted_folders(tmp_path_factory.mktemp("stage1"), GRAFTED)
    TEACHER_DIGEST[:] = [digest(teacher)]
    return teacher, student


def grafted_folders(root, grafted: list[int]):
    """(teacher, student): a tiny 4-layer converted Llama and its graft at `grafted`, saved under root."""
    tokenizer = base_tokenizer()
    teacher = converted_llama(vocab_size=len(tokenizer), layers=4)
    save_model(teacher, tokenizer, root / "teacher")
    save_model(graft_memory(teacher, grafted, calibration=calibration_ids(tokenizer, 64)), tokenizer, root / "student")
    return root / "teacher", root / "student"


def stage_config(config_class, folders, out, **changes):
    """A tiny stage run's config (stage 1 or 2): the two small tasks, rows of 64 tokens, a high learning rate."""
    teacher, student = folders
    fields = dict(teacher=str(teacher), student=str(student), out=str(out), mixture={"arithmetic": 1.0, "kv_retrieval": 1.0},
                  seq_len=64, rows_per_step=2, lr=1e-2, warmup_steps=2)  # fmt: skip
    return config_class(**{**fields, **changes})


def run_stage(loop_class, cfg):
    """(the run's folder, the trainer) after the whole run."""
    trainer = loop_class(cfg)
    trainer.run()
    return Path(cfg.out), trainer


def config(folders, out, **changes):
    return stage_config(Stage1Config, folders, out, **{"max_steps": 15, **changes})


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory):
    """A 15-step run at a high learning rate: (its folder, the trainer)."""
    return run_stage(GraftStage1, config(folders, tmp_path_factory.mktemp("run") / "stage1"))


def test_each_layers_loss_falls_within_a_few_steps(trained):
    out, _ = trained
    steps = [r for r in logged(out) if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 16))
    first, last = steps[:2], steps[-3:]  # each step's batch is new data: compare a few steps' means

    def mean(records, layer=None):
        return sum(r["loss"] if layer is None else r["layer_loss"][layer] for r in records) / len(records)

    assert mean(last) < 0.7 * mean(first)  # without learning (lr 1e-9) the ratio is 0.91
    assert all(set(r["layer_loss"]) == set(map(str, GRAFTED)) for r in steps)
    for layer in map(str, GRAFTED):  # every layer learns, not only the mean
        assert mean(last, layer) < 0.85 * mean(first, layer), layer
    for record in steps:  # the logged loss is the mean of the layers' normalised errors
        assert record["loss"] == pytest.approx(sum(record["layer_loss"].values()) / len(GRAFTED), abs=1e-4)
        assert record["tokens"] == 2 * 64
    assert (out / "stage1_loss.png").stat().st_size > 0


def test_only_the_grafted_mixers_change(folders, trained):
    teacher_folder, student_folder = folders
    out, trainer = trained
    grafted = load_file(str(student_folder / "model.safetensors"))
    result = load_file(str(out / "student" / "model.safetensors"))
    assert grafted.keys() == result.keys()
    moved = set()
    for name, value in grafted.items():
        if ".linear_attn." in name:
            moved |= {int(name.split(".")[2])} if not torch.equal(result[name], value) else set()
        else:
            assert torch.equal(result[name], value), name  # norms, MLPs, embeddings, the attention layer
    assert moved == set(GRAFTED)
    assert not any(".linear_attn." in name for name in grafted if name.startswith("model.layers.3."))
    # the teacher as loaded, and its folder as written before the run
    assert digest(teacher_folder) == TEACHER_DIGEST[0]
    teacher = load_model(teacher_folder, trainer.teacher.dtype)
    assert all(torch.equal(trainer.teacher.state_dict()[k], v) for k, v in teacher.state_dict().items())
    assert not any(p.requires_grad for p in trainer.teacher.parameters())


def test_the_saved_student_loads_with_its_trained_mixers(folders, trained):
    out, trainer = trained
    for folder in (out / "student", out / "checkpoint"):  # the checkpoint is a model folder too
        loaded = load_model(folder)
        assert loaded.config.layer_types == [MEMORY] * 3 + [ATTENTION]
        for i in GRAFTED:
            want = trainer.student.model.layers[i].linear_attn.state_dict()
            got = loaded.model.layers[i].linear_attn.state_dict()
            assert all(torch.equal(got[k], want[k]) for k in want), (folder, i)
    start = load_model(folders[1]).model.layers[0].linear_attn.in_proj_qkv.weight
    assert not torch.equal(load_model(out / "student").model.layers[0].linear_attn.in_proj_qkv.weight, start)


def test_a_resumed_run_takes_the_steps_of_an_uninterrupted_one(folders, tmp_path, monkeypatch):
    def run(name, resume=False):
        return GraftStage1(config(folders, tmp_path / name, max_steps=6, checkpoint_every=2), resume=resume)

    run("ref").run()
    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        crash_at(GraftStage1, 3, patch)  # after the checkpoint of step 2: step 2 is replayed
        run("run").run()
    with pytest.raises(CloverError, match=r"different configuration than the checkpoint's: lr"):
        GraftStage1(config(folders, tmp_path / "run", max_steps=6, checkpoint_every=2, lr=1e-3), resume=True)
    # eval_every may differ: the shipped hybrid's run recorded 10**9, which evaluated nothing, as 0 does
    resumed = GraftStage1(config(folders, tmp_path / "run", max_steps=6, checkpoint_every=2, eval_every=10**9), resume=True)
    assert resumed.state["step"] == 2 and resumed.state["tokens"] == 2 * 2 * 64
    resumed.run()
    assert logged(tmp_path / "run") == logged(tmp_path / "ref")
    want = load_file(str(tmp_path / "ref" / "student" / "model.safetensors"))
    got = load_file(str(tmp_path / "run" / "student" / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    state = json.loads((tmp_path / "run" / "checkpoint" / "train_state.json").read_text())
    assert state["state"]["step"] == 6 and set(state["state"]) == {"step", "max_steps", "tokens"}


def test_a_student_that_is_not_a_graft_of_the_teacher_is_refused(folders, tmp_path):
    teacher, _ = folders
    with pytest.raises(CloverError, match="no memory layer in place of a teacher's attention layer"):
        GraftStage1(config(folders, tmp_path / "same", student=str(teacher)))
    with pytest.raises(CloverError, match="seq_len must be a positive multiple of 4"):
        GraftStage1(config(folders, tmp_path / "odd", seq_len=66))


def test_a_subset_of_layers_trains_alone_as_it_would_among_all(folders, tmp_path):
    """--layers: only the chosen grafted mixers move and log; the other grafted mixers stay as they came. Stage 1
    is layer-local: the chosen layer ends as it does when every layer trains (the same batches; the loss's
    1 / layers scale reaches Adam only through its eps, where no clip binds), so layers may be trained some at a
    time: in the real run the gradient norm is ~0.014 against a clip of 1."""
    # fp32: under bf16 the loss's scale changes the backward's rounding, which Adam's first steps amplify; and
    # a clip on the norm of all layers' gradients would couple them
    unclipped = dict(max_steps=3, grad_clip=1e9, bf16=False)
    out, one = run_stage(GraftStage1, config(folders, tmp_path / "one", layers=[1], **unclipped))
    _, every = run_stage(GraftStage1, config(folders, tmp_path / "every", **unclipped))
    want = every.student.model.layers[1].linear_attn.state_dict()
    for name, value in one.student.model.layers[1].linear_attn.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=2e-3)  # each moved by ~0.025: 2.5 x lr
    steps = [r for r in logged(out) if "event" not in r]
    assert all(set(r["layer_loss"]) == {"1"} and r["loss"] == r["layer_loss"]["1"] for r in steps)
    grafted = load_file(str(folders[1] / "model.safetensors"))
    result = load_file(str(out / "student" / "model.safetensors"))
    moved = {int(k.split(".")[2]) for k, v in grafted.items() if not torch.equal(result[k], v)}
    assert moved == {1}
    for layers, message in (([3], r"layers \[3\] are not memory layers .* \(those are 0,1,2\)"), ([], "no layers to train")):
        with pytest.raises(CloverError, match=message):
            GraftStage1(config(folders, tmp_path / "bad", layers=layers))


def test_clover_train_recipe_graft_stage1(folders, tmp_path, capsys):
    teacher, student = folders
    args = ["train", "--recipe", "graft-stage1", "--teacher", str(teacher), "--student", str(student),
            "--out", str(tmp_path / "cli"), "--seq-len", "32", "--fp32"]  # fmt: skip
    main(args + ["--max-steps", "2"])  # the default mixture: the conversion trainer's, chat included
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["layers"] == GRAFTED and summary["teacher"] == "fp32"
    assert summary["tokens"] == 2 * 2 * 32
    assert load_model(tmp_path / "cli" / "student").config.layer_types[:3] == [MEMORY] * 3
    main(args + ["--max-steps", "3", "--resume"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3
    two = [str(tmp_path / "two") if a == str(tmp_path / "cli") else a for a in args]
    main(two + ["--max-steps", "1", "--layers", "0,2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["layers"] == [0, 2]
    with pytest.raises(SystemExit):
        main(args[:5] + ["--out", str(tmp_path / "none")])  # no --student
    assert "needs --teacher DIR and --student DIR" in capsys.readouterr().err


def test_the_curves_running_mean_averages_each_value_with_the_window_before_it():
    assert running_mean([1.0, 2.0, 3.0, 4.0, 10.0], 3) == [1.0, 1.5, 2.0, 3.0, 17 / 3]
    assert running_mean([5.0, 7.0], 1) == [5.0, 7.0]
    assert running_mean([], 4) == []
