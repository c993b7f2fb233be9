"""The graft folder (convert/graft_folder.py): a hybrid stored as its teacher plus its memory layers' mixers,
loaded by load_model, published by the graft's stages and continued from on another machine."""

import json
from pathlib import Path

import pytest
import torch

import cloverlm.convert.graft_folder as graft_folder
from cloverlm.convert.graft_folder import (
    GRAFT_META,
    graft_meta,
    save_graft_folder,
    teacher_digest,
    teacher_folder,
)
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.errors import CloverError
from cloverlm.model.config import MEMORY
from cloverlm.training.graft.stage1 import GraftStage1, Stage1Config
from cloverlm.training.graft.stage2 import GraftStage2, Stage2Config
from cloverlm.training.loop import lr_at
from test_graft_stage1 import grafted_folders, run_stage, stage_config
from test_training_loop import logged

GRAFTED = [0, 2]  # layers 1 and 3 stay attention


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return grafted_folders(tmp_path_factory.mktemp("graft_folder"), GRAFTED)


@pytest.fixture(scope="module")
def trained_student(folders):
    """The graft with its mixers moved away from the graft's start, as training moves them."""
    _, student_path = folders
    student = load_model(student_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in GRAFTED:
            for param in student.model.layers[layer].linear_attn.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    return student


def written(folders, student, folder, **changes):
    teacher_path, _ = folders
    save_graft_folder(student, load_model(teacher_path), teacher_path, folder, runs={"note": "test"}, **changes)
    return folder


def test_a_graft_folder_loads_as_its_student_with_the_mixers_rounded_to_fp16(folders, trained_student):
    folder = written(folders, trained_student, folders[0].parent / "hybrid")
    loaded = load_model(folder)
    assert loaded.config.layer_types == trained_student.config.layer_types
    teacher = load_model(folders[0]).state_dict()
    stored = {k: v for k, v in trained_student.state_dict().items()}
    for key, value in loaded.state_dict().items():
        if ".linear_attn." in key:
            assert torch.equal(value, stored[key].half().float()), key
        else:  # everything else is the teacher's own weight, loaded from the teacher's folder
            assert torch.equal(value, teacher[key]), key
    ids = torch.randint(5, 200, (1, 24))
    rounded = load_model(folders[1])
    rounded.load_state_dict({k: v.half().float() if ".linear_attn." in k else v for k, v in stored.items()})
    assert torch.allclose(loaded(ids, ids, [8, 8, 8]).logits, rounded(ids, ids, [8, 8, 8]).logits, atol=1e-5)
    meta = json.loads((folder / GRAFT_META).read_text())
    assert meta["memory_layers"] == GRAFTED and meta["runs"] == {"note": "test"}
    assert meta["teacher"] == "../teacher"  # relative: the folder and its teacher move together
    assert load_folder_tokenizer(folder).get_vocab() == load_folder_tokenizer(folders[0]).get_vocab()


def test_the_mixers_split_into_parts_a_layer_each_under_the_size_limit(folders, trained_student, tmp_path, monkeypatch):
    one_layer = sum(p.numel() for p in trained_student.model.layers[0].linear_attn.parameters()) * 2
    monkeypatch.setattr(graft_folder, "MAX_PART_BYTES", one_layer + 1)
    folder = written(folders, trained_student, tmp_path / "hybrid")
    meta = json.loads((folder / GRAFT_META).read_text())
    assert meta["parts"] == ["mixers-00001-of-00002.safetensors", "mixers-00002-of-00002.safetensors"]
    assert all((folder / name).stat().st_size <= one_layer + 20_000 for name in meta["parts"])
    assert torch.equal(load_model(folder).model.layers[2].linear_attn.out_proj.weight,
                       trained_student.model.layers[2].linear_attn.out_proj.weight.half().float())  # fmt: skip


def test_a_folder_refuses_a_missing_part_mixers_of_other_layers_a_changed_teacher_and_values_beyond_fp16(folders, trained_student, tmp_path):
    folder = written(folders, trained_student, tmp_path / "hybrid")
    (folder / "mixers-00001-of-00001.safetensors").rename(tmp_path / "away")
    with pytest.raises(CloverError, match="is missing: the graft folder is incomplete"):
        load_model(folder)
    (tmp_path / "away").rename(folder / "mixers-00001-of-00001.safetensors")
    meta = json.loads((folder / GRAFT_META).read_text())
    (folder / GRAFT_META).write_text(json.dumps({**meta, "memory_layers": [0]}))
    with pytest.raises(CloverError, match="mixers do not fit its memory layers: missing \\[\\], unexpected \\['model.layers.2"):
        load_model(folder)
    (folder / GRAFT_META).write_text(json.dumps({**meta, "teacher_sha256": "0" * 64}))
    with pytest.raises(CloverError, match="trained on other weights than .* holds now"):
        load_model(folder)
    with torch.no_grad():
        trained_student.model.layers[2].linear_attn.dt_bias[0] += 1e5
    try:
        with pytest.raises(CloverError, match="dt_bias has values that fp16 cannot hold"):
            written(folders, trained_student, tmp_path / "other")
    finally:
        with torch.no_grad():
            trained_student.model.layers[2].linear_attn.dt_bias[0] -= 1e5


def test_a_stage_published_on_one_machine_continues_from_its_folder_on_another(folders, tmp_path):
    """Stage 1 publishes with its checkpoints and stops at step 3 of 6; the run's folder is then lost (another
    machine). --resume with the published folder as student takes up step 3, its log and tokens; stage 2 on
    the finished folder keeps stage 1's record and log beside its own."""
    published = tmp_path / "hybrid"
    cfg = stage_config(Stage1Config, folders, tmp_path / "first", max_steps=6, publish=str(published))
    GraftStage1(cfg).run(stop_at=3)
    meta = json.loads((published / GRAFT_META).read_text())
    assert meta["runs"]["graft-stage1"]["state"]["step"] == 3
    assert meta["files"] == ["graft-stage1_log.jsonl", "stage1_loss.png"]
    weights = load_model(published).state_dict()

    again = stage_config(Stage1Config, (folders[0], published), tmp_path / "second", max_steps=6, publish=str(published))
    trainer = GraftStage1(again, resume=True)
    assert trainer.state["step"] == 3
    assert all(torch.equal(v, weights[k]) for k, v in trainer.student.state_dict().items())
    trainer.run()
    records = logged(tmp_path / "second")
    assert [r["step"] for r in records if "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert [r["event"] for r in records if "event" in r] == ["continued from a graft folder"]
    schedule = [lr_at(step, again, 6) for step in range(6)]
    rewarmed = schedule[:3] + [schedule[3] / 2] + schedule[4:]  # warmup_steps 2: half the rate, then all of it
    assert [r["lr"] for r in records if "event" not in r] == pytest.approx(rewarmed)
    state = json.loads((published / GRAFT_META).read_text())["runs"]["graft-stage1"]["state"]
    assert state["step"] == 6 and state["tokens"] == 6 * 2 * 64

    with pytest.raises(CloverError, match="--resume with a different configuration than the checkpoint's: seq_len"):
        GraftStage1(stage_config(Stage1Config, (folders[0], published), tmp_path / "third", seq_len=32), resume=True)

    stage2 = stage_config(Stage2Config, (folders[0], published), tmp_path / "stage2", max_steps=2, bf16=False,
                          publish=str(tmp_path / "hybrid2"))  # fmt: skip
    run_stage(GraftStage2, stage2)
    meta = json.loads((tmp_path / "hybrid2" / GRAFT_META).read_text())
    assert sorted(meta["runs"]) == ["graft-stage1", "graft-stage2"] and meta["runs"]["graft-stage1"]["state"]["step"] == 6
    assert meta["files"] == ["graft-stage1_log.jsonl", "graft-stage2_log.jsonl", "stage1_loss.png", "stage2_kl.png"]


SHIPPED_HYBRID = Path(__file__).resolve().parents[1] / "models" / "smollm2-clover-hybrid"


def test_the_shipped_hybrid_was_trained_on_the_shipped_teacher_and_keeps_the_size_rule():
    """models/smollm2-clover-hybrid: the default model is its teacher, unchanged since (a retrained default
    needs the graft trained again), every file is under 30 MB, and it loads as the hybrid its record says."""
    meta = graft_meta(SHIPPED_HYBRID)
    assert teacher_folder(SHIPPED_HYBRID) == SHIPPED_HYBRID.parent / "smollm2-clover"
    assert teacher_digest(teacher_folder(SHIPPED_HYBRID)) == meta["teacher_sha256"]
    assert all(path.stat().st_size < 30e6 for path in SHIPPED_HYBRID.iterdir())
    assert meta["runs"]["graft-stage1"]["state"]["tokens"] > 0
    model = load_model(SHIPPED_HYBRID)
    assert [i for i, kind in enumerate(model.config.layer_types) if kind == MEMORY] == meta["memory_layers"]
    ids = torch.tensor([load_folder_tokenizer(SHIPPED_HYBRID)("Hello, drone.")["input_ids"]])
    assert torch.isfinite(model(ids, ids, [ids.shape[1]]).logits).all()
