"""Stage 2 of the memory graft (issue 30, item 4; training/graft/stage2.py): the whole hybrid on logit KL
against the all-attention model, at the noisy slots of the conversion trainer's batches, on a tiny converted
Llama and its graft."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from cloverlm.cli import main
from cloverlm.convert.load import load_model
from cloverlm.training.graft.stage2 import GraftStage2, Stage2Config, distillation_kl
from test_graft_stage1 import grafted_folders, run_stage, stage_config
from test_training_loop import crash_at, logged

GRAFTED = [0, 2]  # layers 1 and 3 stay attention


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return grafted_folders(tmp_path_factory.mktemp("stage2"), GRAFTED)


def config(folders, out, **changes):
    return stage_config(Stage2Config, folders, out, **{"max_steps": 12, "bf16": False, **changes})


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory):
    return run_stage(GraftStage2, config(folders, tmp_path_factory.mktemp("run") / "stage2"))


def test_the_kl_falls_and_the_student_comes_to_agree_with_the_teacher(trained):
    out, _ = trained
    steps = [r for r in logged(out) if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    first, last = steps[:3], steps[-3:]  # each step's batch is new data: compare a few steps' means
    mean = lambda records, key: sum(r[key] for r in records) / len(records)  # noqa: E731
    assert mean(last, "kl") < 0.6 * mean(first, "kl")
    assert mean(last, "agree") > mean(first, "agree")
    assert all(r["loss"] == pytest.approx(r["kl"], abs=1e-4) and r["tokens"] > 0 for r in steps)
    assert (out / "stage2_kl.png").stat().st_size > 0


def test_one_row_at_a_time_gives_the_batchs_kl_and_gradients(trained):
    _, trainer = trained
    batch = trainer.batch(40)
    noised, partition = batch
    slots = int(noised.scored.sum())

    def kl_and_grad(parts):
        trainer.model.zero_grad()
        total = sum(distillation_kl(trainer.student, trainer.teacher, *part)[0] for part in parts)
        total.backward()
        grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        trainer.model.zero_grad()
        return float(total), grad

    kl, grad = kl_and_grad([(noised, partition, slots)])
    apart_kl, apart_grad = kl_and_grad(trainer.micro_batches(batch))
    assert len(trainer.micro_batches(batch)) == 2 and kl > 0
    assert apart_kl == pytest.approx(kl, rel=1e-5)
    torch.testing.assert_close(apart_grad, grad, rtol=1e-4, atol=1e-7)


def test_the_data_term_adds_the_texts_own_cross_entropy_at_the_scored_slots(trained):
    """data_weight > 0 (the conversion objective on the hybrid): the loss is the KL plus that weight times
    the mean cross-entropy of the slots' own targets, over the same count."""
    _, trainer = trained
    noised, partition = trainer.batch(41)
    slots = int(noised.scored.sum())
    with torch.no_grad():
        kl, _ = distillation_kl(trainer.student, trainer.teacher, noised, partition, slots)
        both, stats = distillation_kl(trainer.student, trainer.teacher, noised, partition, slots, data_weight=0.5)
        logits = trainer.student(noised.clean_ids, noised.noisy_ids, partition, logits_mask=noised.scored).logits
        nll = F.cross_entropy(logits.float(), noised.targets[noised.scored])
    assert stats["data_nll"] == pytest.approx(float(nll), rel=1e-5) and float(nll) > 0
    assert float(both) == pytest.approx(float(kl) + 0.5 * float(nll), rel=1e-5)


def test_a_noisy_slot_does_not_read_its_target(trained):
    """The student's prediction at a scored slot is the same whatever the tokens it may not see: the
    masked targets of its block and everything after the block."""
    _, trainer = trained
    noised, partition = trainer.batch(41)
    row = noised.rows([0])
    ends = torch.tensor(partition).cumsum(0)
    block = int((ends <= 20).sum())  # the block that holds position 20
    start, end = (int(ends[block - 1]) if block else 0), int(ends[block])
    changed = row.clean_ids.clone()
    changed[:, start + 1 :] = (changed[:, start + 1 :] + 7) % 1000  # the clean tokens from the block's second on
    noisy = row.noisy_ids.clone()
    hidden = noisy[:, start + 1 : end] == trainer.data.mask_id
    noisy[:, end:] = (noisy[:, end:] + 7) % 1000
    with torch.no_grad():
        before = trainer.student(row.clean_ids, row.noisy_ids, partition).logits[:, start:end]
        after = trainer.student(changed, noisy, partition).logits[:, start:end]
    assert bool(hidden.any()) or end - start == 1
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_only_the_grafted_mixers_change_and_the_teacher_stays(folders, trained):
    out, trainer = trained
    before = load_file(str(folders[1] / "model.safetensors"))
    after = load_file(str(out / "student" / "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(any(k.startswith(f"model.layers.{i}.linear_attn.") for i in GRAFTED) for k in changed)
    assert not any(p.requires_grad for p in trainer.teacher.parameters())


def test_a_resumed_run_takes_the_steps_of_an_uninterrupted_one(folders, tmp_path, monkeypatch):
    def run(name, resume=False):
        return GraftStage2(config(folders, tmp_path / name, max_steps=4, checkpoint_every=2), resume=resume)

    run("ref").run()
    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        crash_at(GraftStage2, 3, patch)
        run("run").run()
    run("run", resume=True).run()
    assert logged(tmp_path / "run") == logged(tmp_path / "ref")
    want = load_file(str(tmp_path / "ref" / "student" / "model.safetensors"))
    got = load_file(str(tmp_path / "run" / "student" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_clover_train_recipe_graft_stage2(folders, tmp_path, capsys):
    teacher, student = folders
    main(["train", "--recipe", "graft-stage2", "--teacher", str(teacher), "--student", str(student),
          "--out", str(tmp_path / "cli"), "--seq-len", "32", "--max-steps", "2", "--fp32"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["layers"] == GRAFTED and summary["teacher"] == "fp32"
    assert load_model(tmp_path / "cli" / "student").config.layer_types == load_model(student).config.layer_types


def test_the_data_weight_is_refused_for_stage_1(folders, tmp_path, capsys):
    teacher, student = folders
    with pytest.raises(SystemExit):
        main(["train", "--recipe", "graft-stage1", "--teacher", str(teacher), "--student", str(student),
              "--out", str(tmp_path / "s1"), "--max-steps", "1", "--data-weight", "1"])  # fmt: skip
    assert "--data-weight goes with --recipe graft-stage2" in capsys.readouterr().err
