"""The campaign's promotion rule and bookkeeping (training/conversion/campaign.py), on made-up scores: a candidate is
promoted only beyond noise and only where no guard falls; the shipped log gains a run's lines once; the
README's campaign section is replaced, not stacked."""

import json

from cloverlm.evaluation.campaign import paired_difference
from cloverlm.training.conversion.campaign import (
    README_END,
    README_START,
    _campaign_log,
    _update_readme,
    beats,
)


def _result(**points):
    return {"points": points}


def test_paired_difference_is_prompt_by_prompt():
    a, b = _result(x=[1.0, 0.5, 0.0]), _result(x=[0.5, 0.5, 0.5])
    diff = paired_difference(a, b, ["x"])
    assert diff["mean"] == 0.0 and diff["pairs"] == 3 and abs(diff["stderr"] - 0.2887) < 1e-4


def test_a_gain_within_noise_is_not_promoted_and_a_clear_one_is():
    shipped = _result(nf=[0.0, 0.2, 0.4, 0.2] * 5, tool=[1.0] * 20, chat=[0.86] * 20)
    noisy = _result(nf=[0.4, 0.0, 0.4, 0.2] * 5, tool=[1.0] * 20, chat=[0.86] * 20)  # +0.1 on a quarter of prompts, -0.2 on another
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
    (run / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.0}\n')
    again = _campaign_log(run, '{"step": 478}\n' + first)
    assert [json.loads(line)["step"] for line in again.splitlines()] == [3]


def test_the_readme_section_is_replaced(tmp_path):
    (tmp_path / "README.md").write_text("# Shipped models\n\nintro\n")
    entry = {"shipped": {"no_fly_b1": 0.1, "total_tokens": 10}, "candidate": {"no_fly_b1": 0.2, "total_tokens": 20},
             "decision": {"promote": True}}  # fmt: skip
    for minutes in (60, 90):
        summary = {"date": "2026-12-05", "minutes": minutes, "device": "cpu (2 threads)", "results": {"smollm2-clover": entry}}
        _update_readme(tmp_path, summary)
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# Shipped models\n\nintro\n") and text.count(README_START) == 1 and text.count(README_END) == 1
    assert "train_campaign.sh 90" in text and "train_campaign.sh 60" not in text
    assert "| smollm2-clover (candidate) | 20 | 0.2 |" in text
