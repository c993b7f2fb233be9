"""Which layers of a graft stay attention (issue 30, item 3; training/graft/select.py, convert/graft.py's
restore_attention): each candidate restored to the teacher's attention and scored, on tiny converted Llamas
with the packaged base's tokenizer."""

import json
import re

import pytest
import torch

from cloverlm.cli import main
from cloverlm.convert.base import base_tokenizer
from cloverlm.convert.graft import graft_memory, restore_attention
from cloverlm.convert.graft_folder import save_graft_folder
from cloverlm.convert.load import load_model
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY
from cloverlm.training.graft.select import (
    EVAL_FILE,
    PLOT_FILE,
    REPORT_FILE,
    SelectConfig,
    build_probes,
    combined_score,
    evaluate_students,
    mean_kl,
    next_token_logits,
    rank,
    select_layers,
    share_of,
)
from test_graft import converted_llama, ids

GRAFTED = [0, 1, 2]  # layer 3 stays attention in every student here
SMALL = dict(tokens=128, seq_len=64, kv_prompts=2, needle_contexts=(96, 192), needle_depths=(0.2, 0.8),
             mixture={"arithmetic": 1.0, "kv_retrieval": 1.0, "chat": 1.0})  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return base_tokenizer()


@pytest.fixture(scope="module")
def teacher():
    return converted_llama()


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """(teacher, student, the student's graft list) folders in which layer 1 is the only layer whose memory
    differs from the teacher: the teacher's layers 0 and 2 write nothing (o_proj zero), and their grafted
    mixers copy that zero out_proj, so restoring 0 or 2 changes nothing and restoring 1 gives the teacher."""
    root = tmp_path_factory.mktemp("select")
    model = converted_llama(vocab_size=len(tokenizer), layers=4)
    with torch.no_grad():
        for i in (0, 2):
            model.model.layers[i].self_attn.o_proj.weight.zero_()
    save_model(model, tokenizer, root / "teacher")
    # no calibration: it scales each mixer's output to its attention's, 0 / 0 for these two layers
    save_model(graft_memory(model, GRAFTED), tokenizer, root / "student")
    return root / "teacher", root / "student"


def run(folders, out, **changes):
    teacher, student = folders
    return select_layers(SelectConfig(teacher=str(teacher), student=str(student), out=str(out), **{**SMALL, **changes}),
                         progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def report(folders, tmp_path_factory):
    return run(folders, tmp_path_factory.mktemp("run") / "k1", keep=1)


def test_restoring_a_layer_copies_the_teachers_attention_and_leaves_the_rest(teacher):
    student = graft_memory(teacher, GRAFTED, calibration=ids())
    with torch.no_grad():  # as stage 2 may train them: the restored layer's norms and MLP are the student's
        for param in (*student.model.layers[1].mlp.parameters(), student.model.layers[1].input_layernorm.weight):
            param.add_(0.5)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    restored = restore_attention(student, teacher, [1])
    assert restored.config.layer_types == [MEMORY, ATTENTION, MEMORY, ATTENTION]
    assert student.config.layer_types == [MEMORY] * 3 + [ATTENTION]  # the student is left as it was
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())
    state, wanted = restored.state_dict(), teacher.state_dict()
    attention = {k for k in state if k.startswith("model.layers.1.self_attn.")}
    assert attention and all(torch.equal(state[k], wanted[k]) for k in attention)
    assert state[next(iter(attention))].data_ptr() != wanted[next(iter(attention))].data_ptr()  # a copy
    assert not any(k.startswith("model.layers.1.linear_attn.") for k in state)
    for name, value in state.items():  # every other weight is the student's: mixers, norms, MLPs, embeddings
        if name not in attention:
            assert torch.equal(value, before[name]), name
    assert restored.lm_head.weight.data_ptr() == restored.model.embed_tokens.weight.data_ptr()  # still tied


def test_restoring_every_layer_gives_the_teachers_logits(teacher):
    student = graft_memory(teacher, [0, 1, 2, 3], calibration=ids())
    restored = restore_attention(student, teacher, [3, 0, 2, 1])
    assert restored.config.layer_types == [ATTENTION] * 4
    text = ids(32, 2, seed=5)
    with torch.no_grad():
        want = teacher(text)
        assert torch.allclose(restored(text).logits, want.logits, atol=1e-6)
    assert mean_kl(restored, teacher, list(want.hidden_states), text) == pytest.approx(0.0, abs=1e-6)
    assert mean_kl(student, teacher, list(want.hidden_states), text) > 1e-3  # the all-memory student is not the teacher


def test_probe_logits_are_the_block_size_1_prediction(teacher):
    hybrid = graft_memory(teacher, [0, 2], calibration=ids())
    text, targets = ids(24, 1, seed=7), [5, 6, 9, 23]
    with torch.no_grad():
        for model in (teacher, hybrid):  # the forward of the whole text: position t - 1 predicts token t
            want = model(text).logits[0, [t - 1 for t in targets]]
            assert torch.allclose(next_token_logits(model, text[0].tolist(), targets), want, atol=1e-4)


@pytest.mark.parametrize(
    "layers, message",
    [([], "no layers to restore"), ([4], "out of range"), ([3], r"layers \[3\] are not memory layers"), ([True], "out of range")],
)
def test_bad_restores_get_a_clear_error(teacher, layers, message):
    with pytest.raises(CloverError, match=message):
        restore_attention(graft_memory(teacher, GRAFTED), teacher, layers)


def test_the_layer_whose_restoration_gives_the_teacher_scores_best(report):
    by_layer = {c["layer"]: c for c in report["candidates"]}
    assert sorted(by_layer) == GRAFTED and report["chosen"] == [1]
    assert by_layer[1]["kl"] == pytest.approx(0.0, abs=1e-5) and by_layer[1]["kl_gain"] == pytest.approx(1.0, abs=1e-4)
    assert report["baseline"]["kl"] > 1e-3
    for layer in (0, 2):  # restoring a layer that already wrote what its attention wrote changes nothing
        assert by_layer[layer]["kl"] == pytest.approx(report["baseline"]["kl"], rel=1e-4)
        assert by_layer[layer]["score"] == pytest.approx(0.0, abs=1e-4)
    assert by_layer[1]["kv"] == report["teacher_scores"]["kv"] and by_layer[1]["needle"] == report["teacher_scores"]["needle"]
    assert [by_layer[i]["rank"] for i in GRAFTED] == [2, 1, 3]  # a tie between 0 and 2: the lower index first
    assert report["selected"]["kl"] == pytest.approx(0.0, abs=1e-5)


def test_the_report_has_its_documented_fields(report):
    out = report
    assert {"teacher", "student", "config", "rule", "data", "teacher_scores", "baseline", "candidates", "chosen",
            "attention_layers", "memory_layers", "memory_layers_arg", "selected", "device", "dtype", "seconds"} <= set(out)  # fmt: skip
    for candidate in out["candidates"]:
        assert {"layer", "kl", "kv", "needle", "needle_by_context", "recall", "kl_gain", "recall_gain", "score", "rank"} <= set(candidate)
    assert set(out["baseline"]) == {"kl", "kv", "needle", "needle_by_context", "recall"}
    assert set(out["baseline"]["needle_by_context"]) == {"96", "192"}
    assert out["attention_layers"] == [1, 3] and out["memory_layers"] == [0, 2] and out["memory_layers_arg"] == "0,2"
    data = out["data"]
    assert data["kl_tokens"] == 128 and data["kv_tokens"] > 0
    assert [n["context"] for n in data["needles"]] == [96, 96, 192, 192]
    assert all(abs(n["tokens"] - n["context"]) <= 0.1 * n["context"] and n["scored"] > 0 for n in data["needles"])
    assert out["config"]["keep"] == 1 and out["dtype"] in ("float32", "bfloat16")


def test_selection_is_deterministic_for_a_seed_and_follows_keep(folders, report, tmp_path):
    def comparable(out: dict) -> dict:  # all but the wall time and the output folder
        return {**{k: v for k, v in out.items() if k != "seconds"}, "config": {**out["config"], "out": None}}

    again = run(folders, tmp_path / "again", keep=1)
    assert comparable(again) == comparable(report)
    assert json.loads((tmp_path / "again" / REPORT_FILE).read_text())["candidates"] == report["candidates"]
    assert (tmp_path / "again" / PLOT_FILE).stat().st_size > 0
    two = run(folders, tmp_path / "two", keep=2)
    assert two["candidates"] == report["candidates"]  # the same scores and ranks
    assert two["chosen"] == [0, 1] and two["memory_layers_arg"] == "2"  # the best two: 1, then 0 before 2
    other = run(folders, tmp_path / "other", keep=1, seed=1)
    assert other["chosen"] == [1] and other["baseline"]["kl"] != report["baseline"]["kl"]  # other data, same answer


def test_evaluation_gives_each_students_kl_and_its_recall_beside_the_teachers(folders, report, tmp_path):
    """The student's scores are the selection's baseline on the same probes; the student with layer 1 restored
    is the teacher in all but weights nothing reads: KL 0, the teacher's recall."""
    teacher, student = folders
    restored = tmp_path / "restored"
    save_model(restore_attention(load_model(student), load_model(teacher), [1]), base_tokenizer(), restored)
    # the student as a graft folder with a run's record: the report says which training state it measured
    published = tmp_path / "published"
    state = {"step": 3, "max_steps": 6, "tokens": 384}
    save_graft_folder(load_model(student), load_model(teacher), teacher, published, {"graft-stage1": {"state": state, "config": {}}})
    cfg = SelectConfig(teacher=str(teacher), out=str(tmp_path / "eval"), **SMALL)
    out = evaluate_students(cfg, [str(student), str(restored), str(published)], progress=False)
    written = json.loads((tmp_path / "eval" / EVAL_FILE).read_text())
    assert written["students"] == out["students"] and "keep" not in written["config"]
    graft, back, folder = out["students"]
    assert graft["trained"] is None and back["trained"] is None and folder["trained"] == {"graft-stage1": state}
    assert folder["memory_layers"] == GRAFTED and folder["kl"] == pytest.approx(graft["kl"], abs=1e-3)
    assert out["teacher_scores"] == report["teacher_scores"]
    assert {k: graft[k] for k in report["baseline"]} == report["baseline"]
    assert graft["memory_layers"] == GRAFTED and back["memory_layers"] == [0, 2]
    teacher_scores = out["teacher_scores"]
    assert back["kl"] == pytest.approx(0.0, abs=1e-5) and back["recall"] == teacher_scores["recall"]
    for key in ("kv", "needle", "recall"):  # a share of the teacher's, none where the teacher recalls nothing
        assert graft[f"{key}_of_teacher"] == (graft[key] / teacher_scores[key] if teacher_scores[key] else None)
        assert back[f"{key}_of_teacher"] == (1.0 if teacher_scores[key] else None)
    assert share_of(0.45, 0.9) == 0.5 and share_of(None, 0.9) is None and share_of(0.2, 0.0) is None
    with pytest.raises(CloverError, match="not a graft of the teacher"):
        evaluate_students(cfg, [str(_shallower(tmp_path))], progress=False)


def _shallower(root):
    folder = root / "shallower"
    save_model(converted_llama(vocab_size=len(base_tokenizer()), layers=3), base_tokenizer(), folder)
    return folder


def test_probes_are_a_function_of_the_seed(tokenizer):
    cfg = SelectConfig(**SMALL)
    first, second = build_probes(tokenizer, cfg), build_probes(tokenizer, cfg)
    assert torch.equal(first.text, second.text) and first.kv == second.kv and first.needle == second.needle
    other = build_probes(tokenizer, SelectConfig(**{**SMALL, "seed": 3}))
    assert not torch.equal(other.text, first.text) and other.kv != first.kv
    for probe in first.kv + first.needle:  # only value tokens are scored: never the JSON around them
        text = tokenizer.decode([probe.ids[t] for t in probe.targets])
        assert "{" not in text and "k-" not in text and text.strip()
    for needle in first.needle:  # the needle's line, the question and the answer name its key; the haystack none
        assert len(set(re.findall(r"k-[0-9a-f]{6}", tokenizer.decode(needle.ids)))) == 1
        assert len(re.findall(r"k-[0-9a-f]{6}", tokenizer.decode(needle.ids))) == 3


def test_scores_combine_kl_and_recall_gains_and_rank_ties_by_index():
    baseline, teacher = {"kl": 2.0, "recall": 0.2}, {"recall": 0.6}
    assert combined_score({"kl": 1.0, "recall": 0.4}, baseline, teacher) == pytest.approx({"kl_gain": 0.5, "recall_gain": 0.5, "score": 1.0})
    no_gap = combined_score({"kl": 1.5, "recall": 0.9}, baseline, {"recall": 0.1})  # the teacher recalls no better
    assert no_gap["recall_gain"] == 0.0 and no_gap["score"] == 0.25
    assert rank([{"layer": 5, "score": 0.3}, {"layer": 2, "score": 0.3}, {"layer": 9, "score": 0.4}]) == [9, 2, 5]


def test_clover_graft_select(folders, tmp_path, capsys):
    teacher, student = folders
    args = ["graft-select", "--teacher", str(teacher), "--student", str(student), "--out", str(tmp_path / "cli"), "--keep", "2",
            "--tokens", "64", "--seq-len", "32", "--kv-prompts", "1", "--fp32"]  # fmt: skip
    main(args + ["--needle-context", "96", "--needle-depths", "0.5", "--save-hybrid"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["chosen"] == [0, 1] and summary["memory_layers"] == "2" and summary["attention_layers"] == [0, 1, 3]
    assert "--memory-layers 2 " in summary["convert"]
    hybrid, grafted = load_model(summary["hybrid"]), load_model(student)  # the student's mixer of layer 2 kept
    assert hybrid.config.layer_types == [ATTENTION, ATTENTION, MEMORY, ATTENTION]
    want = grafted.model.layers[2].linear_attn.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in hybrid.model.layers[2].linear_attn.state_dict().items())
    written = json.loads((tmp_path / "cli" / REPORT_FILE).read_text())
    assert written["config"]["needle_contexts"] == [96] and written["dtype"] == "float32"
    main(args + ["--needle-context", "none"])
    written = json.loads((tmp_path / "cli" / REPORT_FILE).read_text())
    assert written["baseline"]["needle"] is None and "hybrid" not in written
    capsys.readouterr()
    for bad, message in ((["--keep", "4"], "--keep must be between 1 and the 3"), (["--needle-depths", "2"], "between 0 and 1")):
        with pytest.raises(SystemExit):
            main(args + bad)
        assert message in capsys.readouterr().err


def test_clover_graft_eval(folders, tmp_path, capsys):
    teacher, student = folders
    main(["graft-eval", "--teacher", str(teacher), "--students", str(student), str(teacher), "--out", str(tmp_path / "e"),
          "--tokens", "64", "--seq-len", "32", "--kv-prompts", "1", "--needle-context", "none", "--fp32"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    graft, itself = summary["students"]
    assert graft["kl"] > 1e-3 and itself["kl"] == pytest.approx(0.0, abs=1e-5) and itself["recall"] == summary["teacher"]["recall"]
    assert graft["needle"] is None and summary["report"] == str(tmp_path / "e" / EVAL_FILE)
