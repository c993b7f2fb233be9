"""The campaign's promotion rule and bookkeeping (training/conversion/campaign.py), on made-up scores: a candidate is
promoted only beyond noise and only where no guard falls; the shipped log gains a run's lines once; the
README's campaign section is replaced, not stacked."""

import argparse
import json
import shutil

import pytest

from cloverlm.evaluation import campaign as campaign_eval
from cloverlm.evaluation.campaign import paired_difference
from cloverlm.paths import MODELS
from cloverlm.training.conversion.campaign import (
    HISTORY,
    README_END,
    README_START,
    STEP_SHAPE,
    CampaignConfig,
    _campaign_log,
    _promote,
    _update_readme,
    add_arguments,
    beats,
    config_from_args,
    parse_mixture,
    run_campaign,
    trainer_config,
)


def _result(**points):
    return {"points": points}


def test_paired_difference_is_prompt_by_prompt():
    a, b = _result(x=[1.0, 0.5, 0.0]), _result(x=[0.5, 0.5, 0.5])
    diff = paired_difference(a, b, ["x"])
    assert diff["mean"] == 0.0 and diff["pairs"] == 3 and abs(diff["stderr"] - 0.2887) < 1e-4


def test_a_gain_within_noise_is_not_promoted_and_a_clear_one_is():
    shipped = _result(nf=[0.0, 0.2, 0.4, 0.2] * 5, tool=[1.0] * 20, chat=[0.86] * 20)
    noisy = _result(
        nf=[0.4, 0.0, 0.4, 0.2] * 5, tool=[1.0] * 20, chat=[0.86] * 20
    )  # +0.1 on a quarter of prompts, -0.2 on another
    clear = _result(nf=[0.4, 0.6, 0.6, 0.4] * 5, tool=[1.0] * 20, chat=[0.86] * 20)
    assert not beats(noisy, shipped, ["nf"], ["tool", "chat"])["promote"]
    decision = beats(clear, shipped, ["nf"], ["tool", "chat"])
    assert decision["promote"] and decision["primary"]["mean"] == 0.3


def test_a_clear_gain_that_breaks_a_guard_is_not_promoted():
    shipped = _result(nf=[0.0] * 20, tool=[1.0] * 20, chat=[0.86] * 20)
    candidate = _result(nf=[0.5] * 19 + [0.4], tool=[0.0] * 10 + [1.0] * 10, chat=[0.86] * 20)
    decision = beats(candidate, shipped, ["nf"], ["tool", "chat"])
    assert decision["primary"]["mean"] > 0.4 and not decision["promote"]


def test_the_shipped_log_gains_a_runs_lines_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    first = _campaign_log(run, '{"step": 478}\n')
    assert [json.loads(line)["step"] for line in first.splitlines()] == [1, 2]
    assert all(json.loads(line)["campaign"] == str(run) for line in first.splitlines())
    (run / "train_log.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.0}\n'
    )
    again = _campaign_log(run, '{"step": 478}\n' + first)
    assert [json.loads(line)["step"] for line in again.splitlines()] == [3]


def test_the_readme_section_is_replaced(tmp_path):
    (tmp_path / "README.md").write_text("# Shipped models\n\nintro\n")
    entry = {"shipped": {"no_fly_b1": 0.1, "total_tokens": 10}, "candidate": {"no_fly_b1": 0.2, "total_tokens": 20},
             "decision": {"promote": True, "primary": {"mean": 0.1, "stderr": 0.02}}}  # fmt: skip
    for minutes in (60, 90):
        summary = {
            "date": "2026-12-05",
            "minutes": minutes,
            "device": "cpu (2 threads)",
            "mixture": {"no_fly_zones": 0.55, "chat": 0.2},
            "chat_examples": 800,
            "noisy_draws": 2,
            "results": {"smollm2-clover": entry},
        }
        _update_readme(tmp_path, summary)
    text = (tmp_path / "README.md").read_text()
    assert (
        text.startswith("# Shipped models\n\nintro\n")
        and text.count(README_START) == 1
        and text.count(README_END) == 1
    )
    assert "train_campaign.sh 90" in text and "train_campaign.sh 60" not in text  # from the minutes: no command kept
    assert "mixture no_fly_zones=0.55,chat=0.2, chat records: 800, noisy draws per block: 2;" in text
    assert "| smollm2-clover (candidate) | 20 | 0.2 |" in text


def test_the_readme_lists_every_call_of_the_run_in_order(tmp_path):
    entry = {"shipped": {"no_fly_b1": 0.1}, "candidate": {"no_fly_b1": 0.2},
             "decision": {"promote": True, "primary": {"mean": 0.1, "stderr": 0.02}}}
    first = {"date": "2026-12-06", "minutes": 85, "command": "clover campaign --minutes 85 --lr 5e-05",
             "device": "cpu (2 threads)", "results": {"smollm2-clover": entry}}  # fmt: skip
    again = first | {"minutes": 0, "command": "clover campaign --minutes 0 --lr 5e-05"}
    _update_readme(tmp_path, again, [first])
    text = (tmp_path / "README.md").read_text()
    assert "`clover campaign --minutes 85 --lr 5e-05`, then `clover campaign --minutes 0 --lr 5e-05`, on cpu" in text


def test_a_session_that_promotes_nothing_keeps_the_one_that_did(tmp_path):
    """The README's last-session table is replaced each call; the history under it keeps every call."""
    def call(date, promote, b1):
        entry = {"shipped": {"no_fly_b1": 0.5}, "candidate": {"no_fly_b1": b1, "total_tokens": 7},
                 "decision": {"promote": promote, "primary": {"mean": b1 - 0.5, "stderr": 0.02}}}
        return {"date": date, "minutes": 85, "command": f"clover campaign --minutes 85 # {date}", "device": "cpu",
                "results": {"smollm2-clover": entry}}  # fmt: skip

    _update_readme(tmp_path, call("2026-12-06", True, 0.7))
    _update_readme(tmp_path, call("2026-12-07", False, 0.4))
    text = (tmp_path / "README.md").read_text()
    assert "| 2026-12-06 | smollm2-clover | 7 | 0.7 | - | - | - | - | +0.200 (0.020) | yes |" in text
    assert "| 2026-12-07 | smollm2-clover | 7 | 0.4 | - | - | - | - | -0.100 (0.020) | no |" in text
    assert text.index("2026-12-06 | smollm2") < text.index("2026-12-07 | smollm2") and text.count(README_END) == 1
    history = [json.loads(line) for line in (tmp_path / HISTORY).read_text().splitlines()]
    assert [h["command"] for h in history] == ["clover campaign --minutes 85 # 2026-12-06", "clover campaign --minutes 85 # 2026-12-07"]


def test_promotion_swaps_in_the_adapter_and_keeps_the_rest(tmp_path):
    shipped, run = tmp_path / "models" / "smollm2-clover", tmp_path / "run"
    (shipped / "eval").mkdir(parents=True)
    (run / "adapter").mkdir(parents=True)
    for name, text in {"adapter_model.safetensors": "old", "clover_adapter.json": "{}", "calibration.json": "head",
                       "train_log.jsonl": '{"step": 478}\n', "eval/heldout_b1_free.json": "{}"}.items():  # fmt: skip
        (shipped / name).write_text(text)
    (run / "adapter" / "adapter_model.safetensors").write_text("new")
    (run / "adapter" / "clover_adapter.json").write_text('{"total_tokens": 5}')
    (run / "train_log.jsonl").write_text('{"step": 1}\n')
    _promote(run, shipped, {"summary": {"no_fly_b1": 0.5}}, calibrate=False)
    assert (shipped / "adapter_model.safetensors").read_text() == "new"
    assert json.loads((shipped / "clover_adapter.json").read_text()) == {"total_tokens": 5}
    assert (shipped / "calibration.json").read_text() == "head" and (
        shipped / "eval" / "heldout_b1_free.json"
    ).is_file()
    assert json.loads((shipped / "eval" / "campaign.json").read_text())["summary"]["no_fly_b1"] == 0.5
    lines = (shipped / "train_log.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 478} and json.loads(lines[1])["step"] == 1 and len(lines) == 2
    assert not (tmp_path / "models" / "smollm2-clover.tmp").exists()


@pytest.mark.slow
def test_the_campaign_trains_both_to_the_same_step_and_evaluates_them(tmp_path, monkeypatch):
    """`clover campaign` end to end on the shipped pair (copied): a few small steps, one prompt a point, its
    no_fly prompts of 3 messages (20 cost most of this test, and the points' settings are not what it checks)."""
    monkeypatch.setattr(campaign_eval, "SIZES", {task: {"n_messages": 3} for task in campaign_eval.SIZES})
    models = tmp_path / "models"
    for name in ("smollm2-clover", "smollm2-peer"):
        shutil.copytree(MODELS / name, models / name)
    cfg = CampaignConfig(minutes=0.3, out=str(tmp_path / "runs"), models=str(models), prompts=1, rows_per_step=1,
                         tokens_per_step=200, device="cpu", promote=False)  # fmt: skip
    summary = run_campaign(cfg)
    assert summary["clover"]["steps"] >= 1 and summary["peer"]["steps"] == summary["clover"]["steps"]
    for name in ("smollm2-clover", "smollm2-peer"):
        entry = summary["results"][name]
        assert set(entry) == {"shipped", "candidate", "decision"} and "chat" in entry["candidate"]
        cached, source = models / name / "eval" / "campaign.json", MODELS / name / "eval" / "campaign.json"
        assert (
            len(entry["candidate"]) > 5
        )  # every point; and with promote=False the shipped cache stays as it was
        assert (cached.read_text() if cached.exists() else None) == (
            source.read_text() if source.exists() else None
        )
        meta = json.loads((tmp_path / "runs" / name / "adapter" / "clover_adapter.json").read_text())
        parent = json.loads((MODELS / name / "clover_adapter.json").read_text())
        assert meta["total_tokens"] == parent["total_tokens"] + sum(meta["tokens"].values())
    again = run_campaign(CampaignConfig(minutes=0, out=cfg.out, models=cfg.models, prompts=1, device="cpu",
                                        evaluate=False))  # fmt: skip
    assert again["clover"]["steps"] == summary["clover"]["steps"]  # resumed: no step, the same run
    assert not (models / "README.md").exists()  # not copied; a campaign that may not promote writes none


def test_a_campaign_that_has_begun_keeps_its_data_and_step_shape(tmp_path):
    """Defaults may change between sessions; a resumed run still sees the batches it would have seen."""
    fresh = trainer_config(CampaignConfig(minutes=1, out=str(tmp_path)), "diffusion", "cpu")
    assert (fresh.rows_per_step, fresh.tokens_per_step) == STEP_SHAPE["cpu"] and fresh.distractor_weights
    assert fresh.chat_examples is None and fresh.noisy_draws == 1  # a new run draws from every chat record
    state = tmp_path / "smollm2-clover" / "checkpoint" / "train_state.json"
    state.parent.mkdir(parents=True)
    stored = {
        "rows_per_step": 3,
        "tokens_per_step": 900,
        "mixture": {"no_fly_zones": 1.0},
        "full_size_share": 0.3,
    }
    state.write_text(json.dumps({"config": stored}))  # a run begun before distractor_weights existed
    resumed = trainer_config(CampaignConfig(minutes=1, out=str(tmp_path)), "diffusion", "cuda")
    assert (resumed.rows_per_step, resumed.tokens_per_step, resumed.mixture) == (
        3,
        900,
        {"no_fly_zones": 1.0},
    )
    assert resumed.full_size_share == 0.3 and resumed.distractor_weights == {}
    assert resumed.chat_examples == 128  # the default of its day, stored by asdict
    # a deliberate change to what the run teaches; its step shape stays
    changed = trainer_config(
        CampaignConfig(minutes=1, out=str(tmp_path), mixture={"chat": 1.0}), "diffusion", "cpu"
    )
    assert changed.mixture == {"chat": 1.0} and changed.rows_per_step == 3
    more_chat = trainer_config(CampaignConfig(minutes=1, out=str(tmp_path), chat_examples=800), "diffusion", "cpu")
    assert more_chat.chat_examples == 800 and more_chat.mixture == {"no_fly_zones": 1.0}
    assert more_chat.noisy_draws == 1  # the default of its day, not stored then
    more_noisy = trainer_config(CampaignConfig(minutes=1, out=str(tmp_path), noisy_draws=2), "diffusion", "cpu")
    assert more_noisy.noisy_draws == 2 and more_noisy.chat_examples == 128


def test_a_new_run_takes_its_learning_rate_and_schedule_from_the_command_line(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--minutes", "5", "--out", str(tmp_path), "--lr", "5e-5", "--schedule-steps", "150"])
    cfg = trainer_config(config_from_args(args), "diffusion", "cpu")
    assert (cfg.lr, cfg.max_steps) == (5e-5, 150)
    default = trainer_config(config_from_args(parser.parse_args(["--minutes", "5"])), "ar", "cpu")
    assert (default.lr, default.max_steps) == (CampaignConfig.lr, CampaignConfig.schedule_steps)


def test_a_mixture_is_parsed_or_refused_with_what_is_wrong():
    assert parse_mixture("no_fly_zones=0.5, chat=0.3") == {"no_fly_zones": 0.5, "chat": 0.3}
    for bad in ("no_fly_zones", "chat=x", "chat=0", "chat=-1,tool_call=2"):
        with pytest.raises(argparse.ArgumentTypeError, match="mixture"):
            parse_mixture(bad)


def test_an_evaluation_cut_short_resumes_at_the_first_point_it_lacks(tmp_path, monkeypatch):
    """An hour of CPU for a pair of models: each point is cached as it is computed, and a second call with
    the same adapter computes only the points the first did not reach."""
    import cloverlm.convert.load
    import cloverlm.evaluation.campaign as campaign

    folder = tmp_path / "smollm2-clover"
    shutil.copytree(MODELS / "smollm2-clover", folder, ignore=shutil.ignore_patterns("eval"))
    monkeypatch.setattr(cloverlm.convert.load, "load_model", lambda *args, **kwargs: None)
    monkeypatch.setattr(cloverlm.convert.load, "load_folder_tokenizer", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        campaign, "teacher_forced_agreement", lambda model, tokenizer, chats: [0.5] * len(chats)
    )
    asked = []

    def evaluate_tasks(model, tokenizer, names, prompts, block_size, **kwargs):
        asked.append((names[0], block_size))
        if len(asked) == 3:
            raise KeyboardInterrupt  # the session ends during the third point
        return {
            names[0]: {
                "per_prompt": [{campaign.METRIC[names[0]]: 1.0}] * prompts,
                "tokens_per_forward": 2.0,
                "seconds": 1.0,
            }
        }

    monkeypatch.setattr(campaign, "evaluate_tasks", evaluate_tasks)
    cache_file = tmp_path / "run" / "candidate_eval.json"
    with pytest.raises(KeyboardInterrupt):
        campaign.evaluate_folder(folder, 2, cache=True, cache_file=cache_file)
    assert set(json.loads(cache_file.read_text())["points"]) == {"no_fly_b1", "no_fly_b16"}
    result = campaign.evaluate_folder(folder, 2, cache=True, cache_file=cache_file)
    assert asked[3:] == [("no_fly_zones_unseen", 16), ("tool_call", 16)]  # the third again, then the fourth
    assert (
        set(result["points"]) == set(campaign.CLOVER_POINTS) | {"chat"} and result["summary"]["chat"] == 0.5
    )
    assert (
        campaign.evaluate_folder(folder, 2, cache=True, cache_file=cache_file) == result and len(asked) == 5
    )
    # a point whose decoding changed since (its version) is recomputed; the others are kept
    stored = json.loads(cache_file.read_text())
    stored["versions"]["no_fly_b16"] -= 1
    cache_file.write_text(json.dumps(stored))
    again = campaign.evaluate_folder(folder, 2, cache=True, cache_file=cache_file)
    assert asked[5:] == [("no_fly_zones", 16)] and again["versions"] == result["versions"]
    assert (
        campaign.evaluate_folder(folder, 3, cache=True, cache_file=cache_file)["points"]["no_fly_b1"]
        == [1.0] * 3
    )  # other key
