"""Block-size calibration: the head's fit, the choice rule, save/load, and block_size="auto" end to end."""

import math
from dataclasses import replace

import pytest
import torch

from cloverlm import CloverError
from cloverlm.decoding.calibration import Calibration, load_calibration
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import BlockRecord, DecodeParams, Request
from cloverlm.training.calibrate import RIDGE_GRID, calibrate, fit_head, recost, step_costs
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


def test_the_ridge_is_chosen_by_leave_one_out_error():
    """Fourteen blocks against 64 features: steps that are noise get a near-constant head in most draws (a
    small fixed ridge interpolates them and then predicts noise); steps that follow a feature keep it."""
    constant = 0
    for seed in range(10):
        torch.manual_seed(seed)
        noise = {8: [BlockRecord(h, 8, int(torch.randint(1, 9, ()))) for h in torch.randn(14, 64)]}
        probes, spread = torch.randn(100, 64), {}
        for ridge in (None, 1e-3):
            weight, bias, fit = fit_head(noise, 64, ridge=ridge)
            spread[ridge] = float((probes @ weight[0]).std())
        assert fit[8]["rmse_log_steps"] < 0.05 < fit[8]["loo_rmse_log_steps"]  # the small ridge fits the noise
        constant += spread[None] < 0.05 * spread[1e-3]
    assert constant >= 7
    signal = {8: [BlockRecord(h, 8, 2 if h[0] > 0 else 8) for h in torch.randn(60, 4)]}
    weight, bias, fit = fit_head(signal, 4)
    assert fit[8]["ridge"] < max(RIDGE_GRID) and fit[8]["loo_rmse_log_steps"] < 0.7 * math.log(4)
    assert weight[0, 0] < 0 and weight[0, 1:].abs().max() < weight[0, 0].abs()


def test_the_head_predicts_mean_steps_not_their_geometric_mean():
    """Tokens per second divide by the mean steps: half the blocks in 1 step and half in 16 average 8.5,
    where exp(mean log steps) says 4 and would make the size look twice as fast as it is."""
    torch.manual_seed(0)
    records = {16: [BlockRecord(h, 16, 1 if i % 2 else 16) for i, h in enumerate(torch.randn(40, 32))]}
    weight, bias, fit = fit_head(records, 32)
    predicted = Calibration([16], 0.9, [1.0], weight, bias).predicted_steps(torch.zeros(32))
    assert fit[16]["mean_steps"] == 8.5 and abs(float(predicted[0]) - 8.5) < abs(4.0 - 8.5)


def test_step_costs_come_from_the_decoded_blocks():
    hidden = torch.zeros(3)
    records = {1: [BlockRecord(hidden, 1, 1, 0.030)] * 4,
               8: [BlockRecord(hidden, 8, 2, 0.100), BlockRecord(hidden, 8, 3, 0.150), BlockRecord(hidden, 5, 5, 9.0)],
               16: []}  # fmt: skip
    # size 8: 250 ms over 5 steps (the short last block left out); size 16: its bare 40 ms plus the median
    # the host added at the measured sizes (30 - 10 and 50 - 20 ms)
    assert step_costs(records, [10.0, 20.0, 40.0]) == [30.0, 50.0, 65.0]


def test_auto_divides_by_what_a_step_cost_in_decoding():
    """Two sizes whose bare forwards cost the same, where a step of the large one cost three times as
    much in decoding (its commit, the grammar): the choice follows the decoding cost, per kind."""
    weight, bias = torch.zeros(2, 4), torch.tensor([0.0, math.log(2.0)])  # 1 step at size 1, 2 at size 4
    bare = Calibration([1, 4], 0.9, [10.0, 10.0], weight, bias, constrained=(weight, bias))
    assert bare.choose(torch.zeros(4)) == 4  # 4 tokens in 20 ms against 1 in 10
    measured = replace(bare, step_ms={"free": [10.0, 30.0], "constrained": [10.0, 15.0]})
    assert measured.choose(torch.zeros(4)) == 1  # 4 in 60 ms against 1 in 10
    assert measured.choose(torch.zeros(4), constrained=True) == 4  # 4 in 30 ms


def test_step_costs_grow_with_the_history():
    """Behind a long prompt attention makes the large block's step dearer faster than the small one's:
    the choice turns from 64 to 16 where 64's two steps cost more than four of 16's."""
    weight, bias = torch.zeros(2, 4), torch.tensor([0.0, math.log(2.0)])  # 1 step at 16, 2 at 64
    near = Calibration([16, 64], 0.9, [8.0, 9.0], weight, bias, step_ms={"free": [10.0, 12.0]})
    assert near.cost_ms(context=5000) == [10.0, 12.0]  # no slopes: the costs as measured
    grows = replace(near, forward_context=500, ms_per_1k_context=[1.0, 10.0])
    assert grows.cost_ms() == [10.0, 12.0] and grows.cost_ms(context=500) == [10.0, 12.0]
    assert grows.cost_ms(context=1500) == [11.0, 22.0]
    assert grows.cost_ms(context=0) == [9.5, 7.0]
    assert replace(grows, ms_per_1k_context=[100.0, 100.0]).cost_ms(context=0) == [2.5, 3.0]  # a quarter at least
    assert grows.choose(torch.zeros(4), context=500) == 64  # 64 tokens in 24 ms against 16 in 10
    assert grows.choose(torch.zeros(4), context=3500) == 16  # 64 in 84 ms against 16 in 13


def test_auto_chooses_by_the_row_s_history(random_model):
    """The engine hands the calibration each block's history: the prompt and the answer so far."""
    seen = []

    class Recording(Calibration):
        def choose(self, hidden, constrained=False, context=None):
            seen.append(context)
            return 4

    hidden = random_model.config.hidden_size
    calibration = Recording([4], 0.9, [1.0], torch.zeros(1, hidden), torch.zeros(1))
    prompt = list(range(3, 40))
    [completion] = Engine(random_model, calibration=calibration).generate(
        [Request(prompt, DecodeParams(max_new_tokens=12, block_size="auto"))])
    assert len(completion.tokens) == 12 and seen == [37, 41, 45]


def test_recost_times_the_costs_again_and_keeps_the_heads(tmp_path, random_model):
    hidden = random_model.config.hidden_size
    old = Calibration([1, 4], 0.9, [50.0, 60.0], torch.randn(2, hidden), torch.randn(2),
                      step_ms={"constrained": [70.0, 100.0]}, forward_context=40)  # fmt: skip
    new = recost(random_model, old)
    assert torch.equal(new.weight, old.weight) and torch.equal(new.bias, old.bias) and new.forward_context == 40
    host = [step - forward for step, forward in zip(new.step_ms["constrained"], new.forward_ms)]
    assert host == pytest.approx([20.0, 40.0], abs=1e-2) and new.forward_ms != old.forward_ms
    assert len(new.ms_per_1k_context) == 2 and min(new.ms_per_1k_context) >= 0
    # saved over a report of the older file: the report stays, the new costs win
    new.save(tmp_path, extra={"fit": {"free": {}}, "forward_ms": old.forward_ms, "step_ms": old.step_ms})
    loaded = load_calibration(tmp_path)
    assert (loaded.forward_ms, loaded.step_ms, loaded.ms_per_1k_context) == (new.forward_ms, new.step_ms, new.ms_per_1k_context)
    assert '"fit"' in (tmp_path / "calibration.json").read_text()


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
    assert {kind: len(ms) for kind, ms in calibration.step_ms.items()} == {"free": 3, "constrained": 3}
    assert min(min(ms) for ms in calibration.step_ms.values()) > 0
    calibration.save(tmp_path, extra=report)
    loaded = load_calibration(tmp_path)
    probe = torch.randn(model.config.hidden_size)
    assert loaded.step_ms == calibration.step_ms
    assert loaded.forward_context == report["forward_context"] and len(loaded.ms_per_1k_context) == 3
    assert loaded.ms_per_1k_context == calibration.ms_per_1k_context and min(calibration.ms_per_1k_context) >= 0
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
