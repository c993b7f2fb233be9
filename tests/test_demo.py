"""`clover demo`: the pipeline on tiny random models, the zone parser and checker, the renderers, bad input."""

import io
import json
import struct

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb
from matplotlib.image import imread
from rich.console import Console

from cloverlm import CloverError, preset_config, tasks
from cloverlm.cli import main
from cloverlm.convert.peer import build_peer, peer_config
from cloverlm.decoding.calibration import Calibration
from cloverlm.decoding.params import DecodeParams
from cloverlm.demo.messages import (
    Messages,
    answer_token_budget,
    fit_prompt,
    generated_messages,
    read_messages,
)
from cloverlm.demo.plots import (
    SOURCE_COLORS,
    altitude_ft,
    render_denoising_strip,
    render_zone_map,
    zone_cylinder,
)
from cloverlm.demo.run import DEMO_BLOCK_SIZE, WARM_UP_TOKENS, demo, run_demo, warm_up
from cloverlm.demo.view import DecodeView
from cloverlm.model.checkpoint import save_model
from cloverlm.tasks.base import dumps
from cloverlm.tasks.no_fly_zones import FIELDS, format_prompt, parse_zones, prompt_messages
from conftest import TINY, tiny_model

REPORT_FIELDS = {"clover", "peer", "speedup", "schema", "answers", "block_size"}
CLOVER_FIELDS = {"zones", "wall_s", "tpf", "zone_exact_match"}
PEER_FIELDS = {"zones", "wall_s", "tpf", "zone_exact_match"}
ZONE_A = {"id": "A1234/26", "lat": 47.4581, "lon": 8.5551, "radius": 3.0, "unit": "NM", "lower": "SFC",
          "upper": "400FT", "start": "2026-05-01T08:00Z", "end": "2026-05-01T12:30Z"}
ZONE_B = {"id": "D5678/26", "lat": 47.5372, "lon": 8.6621, "radius": 7.4, "unit": "KM", "lower": "200FT",
          "upper": "2000FT", "start": "2026-06-02T06:30Z", "end": "2026-06-02T18:00Z"}


@pytest.fixture(scope="module")
def clover(tokenizer):
    return tiny_model(vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def peer(tokenizer):
    torch.manual_seed(0)
    model = build_peer(peer_config(preset_config("clover-tiny", **{**TINY, "vocab_size": len(tokenizer)}))).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def quiet_console() -> Console:
    return Console(file=io.StringIO(), width=120)


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG's header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


# ----------------------------------------------------------------------------------------------
# The pipeline


def test_pipeline_end_to_end_writes_the_pictures_and_the_documented_json(clover, peer, tokenizer, tmp_path):
    console = quiet_console()
    report = run_demo(
        clover, tokenizer, generated_messages(0), tmp_path / "out", peer_model=peer,
        json_path=tmp_path / "report.json", block_size=8, max_new_tokens=24, console=console,
    )  # fmt: skip
    for name in ("no_fly_zones.png", "denoising.png"):
        assert (tmp_path / "out" / name).stat().st_size > 5_000
    written = json.loads((tmp_path / "report.json").read_text())
    assert written == report
    assert set(report) == REPORT_FIELDS
    assert set(report["clover"]) == CLOVER_FIELDS and set(report["peer"]) == PEER_FIELDS
    assert report["clover"]["wall_s"] > 0 and report["peer"]["wall_s"] > 0
    # the speedup is of the unrounded wall times; the report's are rounded to milliseconds
    peer_s, clover_s = report["peer"]["wall_s"], report["clover"]["wall_s"]
    rounding = peer_s / clover_s * (0.0005 / peer_s + 0.0005 / clover_s)
    assert report["speedup"] == pytest.approx(peer_s / clover_s, abs=rounding + 0.001)
    assert 0 < report["clover"]["tpf"] <= 8
    for model in ("clover", "peer"):  # random models: nothing parses, and the score says so
        assert report[model]["zones"] == [] and report[model]["zone_exact_match"] == 0.0
    shown = console.file.getvalue()
    assert "20 air-traffic messages" in shown and " 1. " in shown and "20. " in shown
    assert "Clover: no zones found" in shown and "peer: no zones found" in shown
    assert "truth:" in shown and "zone_exact_match" in shown and "speedup" in shown
    assert report["schema"] and "Clover (block diffusion)" in shown


def test_warm_up_runs_each_model_briefly_and_leaves_the_timed_request_as_it_was(clover, peer, tokenizer):
    """The untimed warm-up reads the timed prompt in both models, decodes at most WARM_UP_TOKENS, and leaves
    the params the timed decode uses untouched (a warm-up that cut them would cut the demo's answer)."""
    prompt_ids = fit_prompt(tokenizer, generated_messages(0).texts, 2_000)[0]
    params = DecodeParams(block_size=8, max_new_tokens=200, stop_token_ids=(tokenizer.eos_token_id,))
    seen = {}  # name -> the length of each batch of ids the model embeds

    def record(name):
        return lambda module, args, out: seen.setdefault(name, []).append(args[0].shape[1])

    hooks = [model.get_input_embeddings().register_forward_hook(record(name)) for name, model in (("clover", clover), ("peer", peer))]
    try:
        warm_up(clover, peer, prompt_ids, params, lambda: None)
    finally:
        for hook in hooks:
            hook.remove()
    assert params.max_new_tokens == 200
    assert seen["peer"][0] == len(prompt_ids) and all(n == 1 for n in seen["peer"][1:])  # the prompt, then a token each
    assert 1 < len(seen["peer"]) <= WARM_UP_TOKENS
    assert seen["clover"][0] == len(prompt_ids) - 1  # the prefill (the last prompt token opens the first block)
    # then at most a forward per token, each embedding a block to commit and one to denoise
    assert 1 < len(seen["clover"]) <= 1 + 2 * WARM_UP_TOKENS and max(seen["clover"][1:]) <= params.block_size


def test_under_the_schema_even_a_random_model_opens_the_zone_list(clover, peer, tokenizer, tmp_path):
    """Both models decode under the answer's schema by default: the list's opening is forced, and the
    peer reads forced runs in one forward (more than one token a forward); --free decodes without."""
    runs = {}
    for free in (False, True):
        console = quiet_console()
        report = run_demo(clover, tokenizer, generated_messages(0), tmp_path / str(free), peer_model=peer, block_size=8,
                          max_new_tokens=24, console=console, answers="free" if free else "grounded")  # fmt: skip
        runs[free] = (report, console.file.getvalue())
    constrained, free = runs[False][0], runs[True][0]
    assert constrained["schema"] and not free["schema"] and constrained["answers"] == "grounded"
    assert "grounded: every copied value is one written in the messages" in runs[False][1]
    lines = runs[False][1].splitlines()
    for title in ("Clover (block diffusion)", "peer (autoregressive)"):  # each answer's first line, in its panel
        first = lines[next(i for i, line in enumerate(lines) if title in line) + 1]
        answer = first.strip("│ ")
        assert answer == "[]" or answer.startswith('[{"id":"'), first  # free, a random model writes neither
    assert constrained["peer"]["tpf"] >= 1 == free["peer"]["tpf"]  # forced runs: one forward each


def test_users_file_without_peer_has_no_truth_and_nulls_in_the_json(clover, tokenizer, tmp_path):
    messages_file = tmp_path / "messages.txt"
    messages_file.write_text("Hello tower, any news?\n\nWIND 270/15KT\n")
    report = run_demo(
        clover, tokenizer, read_messages(messages_file), tmp_path, json_path=tmp_path / "r.json",
        max_new_tokens=8, console=quiet_console(),
    )  # fmt: skip
    assert report["peer"] is None and report["speedup"] is None
    assert report["clover"]["zone_exact_match"] is None and set(report["clover"]) == CLOVER_FIELDS
    assert json.loads((tmp_path / "r.json").read_text()) == report


def test_too_many_messages_are_cut_to_the_prompt_limit_with_a_note(clover, tokenizer, tmp_path):
    messages = generated_messages(1).texts * 10  # 200 messages, far past a 600-token limit
    console = quiet_console()
    run_demo(clover, tokenizer, Messages(messages), tmp_path, prompt_token_limit=600, max_new_tokens=4, console=console)
    ids, kept = fit_prompt(tokenizer, messages, 600)
    assert 1 <= kept < 20 and len(ids) <= 600
    assert len(fit_prompt(tokenizer, messages[: kept + 1], 10_000)[0]) > 600  # one more would not fit
    shown = " ".join(console.file.getvalue().split())
    assert f"only the first {kept} of 200 messages fit the 600-token prompt limit; the other {200 - kept} are dropped" in shown


def test_a_message_longer_than_the_limit_alone_is_an_error(tokenizer):
    with pytest.raises(CloverError, match="message 1 alone makes a prompt of"):
        fit_prompt(tokenizer, ["NOTAM " * 500, "short"], 200)


def test_answer_budget_grows_with_the_messages_up_to_five_zones():
    assert answer_token_budget(1) == 96 and answer_token_budget(3) == 256
    assert answer_token_budget(20) == answer_token_budget(5000) == 416


def test_decode_view_splits_blocks(tokenizer):
    mask = 2
    view = DecodeView(tokenizer, mask)
    a, b, c = tokenizer.encode("[{", add_special_tokens=False)[0], 300, 301
    view.on_step(None, [a, mask, mask])  # first block: 3 to generate
    console = quiet_console()
    console.print(view)
    assert "░░" in console.file.getvalue() and "Clover: block 1, 0 tokens committed" in console.file.getvalue()
    view.on_step(None, [a, b, c])
    view.on_block(None, [a, b, c])
    view.on_step(None, [c, mask])  # second block, one step
    view.on_step(None, [c, b])
    assert view.blocks == [[[a, mask, mask], [a, b, c]], [[c, mask], [c, b]]]
    assert view.committed_text == tokenizer.decode([a, b, c]) and view.strip_block() == (1, view.blocks[0])
    single = DecodeView(tokenizer, mask)
    single.on_step(None, [a])
    single.on_step(None, [b, mask])
    single.on_step(None, [b, c])
    assert single.strip_block() == (2, [[b, mask], [b, c]])  # the first block that took several steps


# ----------------------------------------------------------------------------------------------
# The zone parser and checker on hand-written outputs


def zone_example(zones):
    messages = [f"Notice {zone['id']}: drones are not allowed" for zone in zones]
    return tasks.base.Example("no_fly_zones", 0, format_prompt(messages), dumps(zones), zones, ())


def check(zones, output):
    return tasks.get_task("no_fly_zones").check(zone_example(zones), output)


def test_checker_on_a_correct_answer_with_chatter_after_it():
    output = dumps([ZONE_A, ZONE_B]) + "\nThat is all.<|im_end|>"
    assert parse_zones(output) == [ZONE_A, ZONE_B]
    scores = check([ZONE_A, ZONE_B], output)
    assert scores["zone_exact_match"] == scores["exact"] == scores["count"] == 1.0
    assert all(scores[f"field/{name}"] == 1.0 for name in FIELDS)


def test_checker_on_a_partly_wrong_answer():
    wrong = {**ZONE_B, "lat": 50.0373, "radius": "7.4"}  # one digit off; a number given as a string
    scores = check([ZONE_A, ZONE_B], dumps([ZONE_A, wrong]))
    assert scores["zone_exact_match"] == 0.5 and scores["exact"] == 0.0 and scores["count"] == 1.0
    assert scores["field/lat"] == scores["field/radius"] == 0.5 and scores["field/lon"] == 1.0
    # a missing zone and an invented one: each counts against the other
    scores = check([ZONE_A, ZONE_B], dumps([{**ZONE_A, "id": "X9999/26"}, ZONE_B, ZONE_A]))
    assert scores["zone_exact_match"] == pytest.approx(2 / 3) and scores["count"] == 0.0


def test_checker_when_there_is_no_zone_to_find():
    scores = check([], "[]<|im_end|>")
    assert scores["zone_exact_match"] == scores["field/lat"] == scores["exact"] == scores["count"] == 1.0
    scores = check([], dumps([ZONE_A]))
    assert scores["zone_exact_match"] == scores["field/lat"] == scores["count"] == 0.0


@pytest.mark.parametrize(
    "output",
    ["", "no zones today", "[[[[", '{"id": "A1234/26"}', "[1, 2, 3]",
     dumps([ZONE_A, ZONE_B])[:-40],  # cut off inside the second zone: the list does not parse
     dumps([ZONE_A])[:-1]],  # cut off before the closing bracket
)  # fmt: skip
def test_garbage_and_truncated_answers_parse_to_no_zones_and_score_zero(output):
    assert check([], output)["zone_exact_match"] == 0.0  # with no zone to find, only a list is right
    assert parse_zones(output) == []
    scores = check([ZONE_A], output)
    assert scores["zone_exact_match"] == 0.0 and scores["field/id"] == 0.0


def test_prompt_helpers_round_trip_the_generators_prompts():
    example = tasks.generate("no_fly_zones", 5, n_messages=7)
    messages = prompt_messages(example.prompt)
    assert len(messages) == 7 and not messages[0].startswith("1.")
    assert format_prompt(messages) == example.prompt


# ----------------------------------------------------------------------------------------------
# The renderers


def test_zone_geometry_converts_units_and_refuses_what_cannot_be_drawn():
    cylinder = zone_cylinder({**ZONE_A, "lat": 60.0, "radius": 6.0})
    assert cylinder.radius_deg == pytest.approx(0.1) and cylinder.lon_radius_deg == pytest.approx(0.2)
    assert (cylinder.lower_ft, cylinder.upper_ft, cylinder.label) == (0.0, 400.0, "A1234/26")
    assert zone_cylinder({**ZONE_A, "radius": 1.852, "unit": "KM"}).radius_deg == pytest.approx(1 / 60)
    assert altitude_ft("FL050") == 5000 and altitude_ft(" 1200ft ") == 1200 and altitude_ft("GND") == 0
    for broken in ({"lat": "north"}, {"unit": "MI"}, {"upper": "SFC"}, {"radius": -1}, {"lat": True},
                   {"lower": "high"}, {"lon": 200.0}):  # fmt: skip
        assert zone_cylinder({**ZONE_A, **broken}) is None
    assert zone_cylinder({"id": "A1/26"}) is None


def color_pixels(image, color: str) -> int:
    """How many pixels of an RGB(A) image are (nearly) `color`."""
    return int((np.abs(image[..., :3] - np.array(to_rgb(color))).sum(-1) < 0.05).sum())


def test_map_of_known_zones_has_the_right_size_and_draws_each_source(tmp_path):
    path = tmp_path / "maps" / "zones.png"
    garbage = {"id": "?", "lat": "x"}
    drawn = render_zone_map({"truth": [ZONE_A, ZONE_B], "Clover": [ZONE_A, garbage], "peer": []}, path, "test")
    assert drawn == {"truth": 2, "Clover": 1, "peer": 0}
    assert png_size(path) == (900, 700)
    image = imread(path)
    assert color_pixels(image, SOURCE_COLORS["truth"]) > 200 and color_pixels(image, SOURCE_COLORS["Clover"]) > 200
    empty = tmp_path / "empty.png"
    assert render_zone_map({"Clover": []}, empty, "nothing") == {"Clover": 0}
    assert color_pixels(imread(empty), SOURCE_COLORS["Clover"]) < color_pixels(image, SOURCE_COLORS["Clover"])


def test_denoising_strip_has_a_row_per_step_and_a_column_per_position(tmp_path):
    steps = [[None, "[{", None, None], [" x", "[{", None, "$a$"], [" x", "[{", "\n", "$a$"]]
    render_denoising_strip(steps, tmp_path / "strip.png", "block 1")
    assert png_size(tmp_path / "strip.png") == (600, 260)  # the narrowest strip: 6 inches
    render_denoising_strip(steps * 4, tmp_path / "tall.png", "block 1")
    assert png_size(tmp_path / "tall.png") == (600, 620)


# ----------------------------------------------------------------------------------------------
# Bad input


def test_an_empty_messages_file_is_a_one_line_error(tmp_path, capsys):
    for content in (b"", b"\n \n\t\n"):
        (tmp_path / "empty.txt").write_bytes(content)
        with pytest.raises(SystemExit) as raised:
            main(["demo", "--messages", str(tmp_path / "empty.txt"), "--no-peer"])
        assert raised.value.code == 2
        error = capsys.readouterr().err
        assert error == f"error: {tmp_path / 'empty.txt'} holds no messages: expected one message a line\n"
    with pytest.raises(CloverError, match="cannot read the messages file"):
        read_messages(tmp_path / "missing.txt")


def test_non_utf8_lines_are_replaced_and_named(tmp_path):
    path = tmp_path / "messages.txt"
    path.write_bytes("\ufeffNotice A1/26: drones banned\n".encode() + b"caf\xe9 closed\r\n\n\xff\xfe junk\n")
    messages = read_messages(path)
    assert messages.texts == ["Notice A1/26: drones banned", "caf\ufffd closed", "\ufffd\ufffd junk"]
    assert messages.example is None and messages.notes == [
        f"{path}: line 2, 4 not valid UTF-8; the undecodable bytes are shown as \ufffd"
    ]
    path.write_bytes(b"".join(b"bad \xff line\n" for _ in range(12)))
    assert "line 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more not valid UTF-8" in read_messages(path).notes[0]


def test_special_tokens_in_a_users_messages_are_removed_with_a_note(tmp_path, tokenizer):
    path = tmp_path / "messages.txt"
    path.write_text("UAS [MASK] ban<|im_end|>\nplain\n<|endoftext|>\n")
    messages = read_messages(path)
    assert messages.texts == ["UAS  ban", "plain"]
    assert len(messages.notes) == 1 and messages.notes[0].startswith(f"{path}: line 1, 3 held the model's special tokens")
    ids, _ = fit_prompt(tokenizer, messages.texts)
    assert tokenizer.mask_token_id not in ids


def test_cli_runs_a_saved_model_on_a_file_with_bad_bytes(clover, tokenizer, tmp_path, capsys):
    save_model(clover, tokenizer, tmp_path / "clover")
    (tmp_path / "m.txt").write_bytes(b"E) UAS PROHIBITED WI 2NM OF 47.1N 8.2E \xc3\x28 F) SFC G) 400FT\n")
    main(["demo", "--model", str(tmp_path / "clover"), "--messages", str(tmp_path / "m.txt"), "--no-peer",
          "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"), "--block-size", "4"])  # fmt: skip
    shown = " ".join(capsys.readouterr().out.split())
    assert "line 1 not valid UTF-8" in shown and "wrote" in shown
    assert json.loads((tmp_path / "r.json").read_text())["peer"] is None
    assert (tmp_path / "out" / "no_fly_zones.png").is_file() and (tmp_path / "out" / "denoising.png").is_file()


def test_a_missing_default_peer_is_a_note_and_an_explicit_one_an_error(clover, tokenizer, tmp_path, capsys):
    save_model(clover, tokenizer, tmp_path / "clover")
    (tmp_path / "m.txt").write_text("hello\n")
    report = demo(tmp_path / "clover", tmp_path / "no-peer-yet", messages_file=tmp_path / "m.txt",
                  out_dir=tmp_path / "out", block_size=4)  # fmt: skip
    assert report["peer"] is None
    assert f"no peer model at {tmp_path / 'no-peer-yet'} yet" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as raised:
        main(["demo", "--model", str(tmp_path / "clover"), "--peer", str(tmp_path / "nothing"),
              "--messages", str(tmp_path / "m.txt")])  # fmt: skip
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: no peer model at {tmp_path / 'nothing'}") and "--no-peer" in error


def test_the_demo_decodes_with_the_block_size_head_where_the_model_has_one(clover, tokenizer, tmp_path, capsys):
    save_model(clover, tokenizer, tmp_path / "clover")
    (tmp_path / "m.txt").write_text("E) UAS PROHIBITED WI 2NM OF 47.1N 8.2E F) SFC G) 400FT\n")
    run = dict(messages_file=tmp_path / "m.txt", out_dir=tmp_path / "out")
    assert demo(tmp_path / "clover", None, **run)["block_size"] == DecodeParams.block_size
    assert "has no block-size head" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(CloverError, match="--block-size auto needs a calibrated model"):
        demo(tmp_path / "clover", None, block_size="auto", **run)
    hidden = clover.config.hidden_size
    Calibration([4, 8], 0.9, [1.0, 1.5], torch.zeros(2, hidden), torch.tensor([0.0, 2.0])).save(tmp_path / "clover")
    report = demo(tmp_path / "clover", None, **run)
    assert report["block_size"] == DEMO_BLOCK_SIZE == "auto" and report["clover"]["tpf"] > 0
    assert "block-size head" not in capsys.readouterr().out
