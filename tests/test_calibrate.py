"""Block-size calibration: the head's fit, the choice rule, save/load, and block_size="auto" end to end."""

import math

import pytest
import torch

from cloverlm import CloverError
from cloverlm.decoding.calibration import Calibration, load_calibration
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import BlockRecord, DecodeParams, Request
from cloverlm.training.calibrate import calibrate, fit_head
from conftest import tiny_model


def test_fit_recovers_steps_that_depend_on_the_hidden_state():
    torch.manual_seed(0)
    hidden = torch.randn(200, 8)
    # size 8 takes 2 steps where feature 0 is positive (an easy context) and 8 where it is not
    records = {
        1: [BlockRecord(h, 1, 1) for h in hidden],
        8: [BlockRecord(h, 8, 2 if h[0] > 0 else 8) for h in hidden],
    }
    weight, bias, fit = fit_head(records, 8, ridge=1e-3)
    calibration = Calibration([1, 8], 0.9, [1.0, 1.5], weight, bias)
    easy, hard = torch.zeros(8), torch.zeros(8)
    easy[0], hard[0] = 2.0, -2.0
    assert calibration.predicted_steps(easy)[0] == pytest.approx(1.0)
    assert calibration.predicted_steps(easy)[1] < calibration.predicted_steps(hard)[1]
    # 8 tokens in ~2 steps of 1.5 ms beats 1 token per 1 ms; 8 steps of 1.5 ms does not
    assert calibration.choose(easy) == 8 and calibration.choose(hard) == 1
    assert fit[8]["blocks"] == 200 and fit[1]["rmse_log_steps"] == pytest.approx(0.0, abs=1e-3)


def test_unobserved_sizes_are_assumed_sequential():
    weight, bias, fit = fit_head({4: [], 1: [BlockRecord(torch.ones(3), 1, 1)]}, 3)
    calibration = Calibration([4, 1], 0.9, [1.0, 1.0], weight, bias)
    assert calibration.predicted_steps(torch.randn(3))[0] == pytest.approx(4.0)
    assert fit[4] == {"blocks": 0}


def test_auto_needs_a_calibration():
    with pytest.raises(CloverError, match='block_size="auto" needs a calibrated model'):
        Engine(tiny_model()).submit(Request([5, 6], DecodeParams(block_size="auto")))


def test_calibrate_end_to_end(tmp_path, tokenizer, random_model):
    model = random_model
    calibration, report = calibrate(model, tokenizer, fit_prompts=4, eval_prompts=2, max_new_tokens=12, sizes=(1, 4, 8))
    rows = report["evaluation"]
    assert [(row["requests"], row["block_size"]) for row in rows] == [
        (kind, size) for kind in ("free", "constrained") for size in (1, 4, 8, "auto")]
    # at most a block a forward, and at size 1 exactly one token a forward (forced tokens count as decided)
    assert all(0 < row["tpf"] <= size for row, size in zip(rows, [1, 4, 8, 8] * 2) if row["requests"] == "free")
    assert rows[0]["tpf"] == 1.0
    for kind in ("free", "constrained"):
        assert report["fit"][kind][1]["mean_steps"] == 1.0 and report["fit"][kind][8]["blocks"] > 0
    assert len(calibration.forward_ms) == 3 and min(calibration.forward_ms) > 0
    calibration.save(tmp_path, extra=report)
    loaded = load_calibration(tmp_path)
    probe = torch.randn(model.config.hidden_size)
    for constrained in (False, True):  # two heads, both saved
        assert loaded.choose(probe, constrained) == calibration.choose(probe, constrained)
        torch.testing.assert_close(loaded.predicted_steps(probe, constrained), calibration.predicted_steps(probe, constrained))
    assert not torch.equal(calibration.predicted_steps(probe), calibration.predicted_steps(probe, True))
    assert load_calibration(tmp_path / "nothing") is None

    sizes = []
    request = Request(list(range(3, 40)), DecodeParams(max_new_tokens=30, block_size="auto"))
    engine = Engine(model, calibration=loaded, record_blocks=True)
    [completion] = engine.generate([request])
    sizes = [record.size for record in completion.block_records]
    assert len(completion.tokens) == 30 and sum(sizes) == 30
    assert set(sizes[:-1]) <= {1, 4, 8}
    assert math.isclose(completion.tokens_per_forward, 30 / completion.forwards)
