"""`clover bench`: the report's shape and arithmetic, the plots, the CLI, on tiny random models."""

import dataclasses
import json
import statistics
import struct
import sys

import pytest
import torch

from cloverlm import CloverError, preset_config, tasks
from cloverlm.bench.llama_cpp import load_llama_cpp
from cloverlm.bench.options import BenchModels, BenchOptions, accuracy, parse_context
from cloverlm.bench.report import write_report
from cloverlm.bench.run import run_bench
from cloverlm.bench.sweeps import bench_block_sizes
from cloverlm.bench.tasks import spread_prompts
from cloverlm.cli import main
from cloverlm.convert.graft import default_memory_layers, graft_memory
from cloverlm.convert.peer import build_peer, peer_config, save_peer
from cloverlm.decoding.calibration import Calibration
from cloverlm.decoding.params import DecodeParams
from cloverlm.evaluation.heldout import heldout_examples
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION
from cloverlm.tokenizer import train_tokenizer
from conftest import TINY, tiny_model

VOCAB = 1536  # room for the tokenizer's 1,110 digit groups
TASK_FIELDS = {"clover", "clover_b1", "peer", "peer_lookup", "llama_cpp", "speedup", "speedup_vs", "constrained"}
CLOVER_FIELDS = {"accuracy", "wall_s_median", "tokens_per_s", "tpf"}
PEER_FIELDS = {"accuracy", "wall_s_median", "tokens_per_s"}
SWEEP_FIELDS = {"block_size", "threshold", "tpf", "tokens_per_s", "median_s", "accuracy", "answers"}
SCHEMA_FIELDS = {"parsed", "schema_valid", "truncated", "zone_exact", "tokens", "forwards", "tpf", "forced_share", "wall_s_median", "ms_per_forward", "grammar_ms_per_forward", "refused"}
RATIO_ROUNDING = 5e-4  # speedups are rounded to 3 decimals (bench.options.ratio): 0.024 for 0.02364
CONTEXT_FIELDS = {"context", "clover_block_ms", "memory_only_block_ms", "hybrid_block_ms", "hybrid_vs_clover", "block_tokens", "peer_token_ms", "speedup",
                  "clover_cache_bytes", "memory_only_cache_bytes", "hybrid_cache_bytes", "peer_cache_bytes"}
# short answers keep a run of the bench on tiny models to a few seconds
OPTIONS = BenchOptions(
    tasks=("arithmetic", "kv_retrieval"),
    prompts=3,
    repeats=2,
    contexts=(64, 128),
    timed_forwards=3,
    sweep_task="arithmetic",
    sweep_prompts=2,
    sweep_block_sizes=(4, 16),
    sweep_thresholds=(0.6, 0.95),
    threshold=0.6,  # not DecodeParams' default: the report fixture checks every section decodes at it
    schema_prompts=2,
    schema_messages=2,
    structured_prompts=2,
    load_clients=2,
    load_requests=1,
    decision_prompts=1,
)


def bench_tokenizer():
    texts = [tasks.generate(name, seed).prompt + "\n" + tasks.generate(name, seed).answer for name in tasks.TASKS for seed in range(30)]
    return train_tokenizer(texts, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer():
    return bench_tokenizer()


def tiny_peer():
    torch.manual_seed(0)
    model = build_peer(peer_config(preset_config("clover-tiny", **{**TINY, "vocab_size": VOCAB}))).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def tiny_all_attention(vocab_size: int = VOCAB):
    """A tiny Clover of four block-causal attention layers shaped as a converted Llama's (no q/k norm, no
    output gate): what the graft starts from."""
    return tiny_model(vocab_size=vocab_size, layer_types=[ATTENTION] * 4, attention_qk_norm=False, attention_output_gate=False)


def tiny_hybrid(source):
    """The graft of `source`: memory in layers 0-2, attention kept in layer 3."""
    return graft_memory(source, default_memory_layers(source.config.num_hidden_layers))


def bench_models(tokenizer) -> BenchModels:
    torch.set_num_threads(1)
    return BenchModels(
        clover=tiny_model(vocab_size=VOCAB),
        memory_only=tiny_model("clover-tiny-memory", vocab_size=VOCAB),
        peer=tiny_peer(),
        tokenizer=tokenizer,
        folders={"clover": "tiny", "memory_only": "tiny-memory", "peer": "tiny-peer", "hybrid": "tiny-hybrid"},
        hybrid=tiny_hybrid(tiny_all_attention()),
    )


@pytest.fixture(scope="module")
def models(tokenizer):
    return bench_models(tokenizer)


@pytest.fixture(scope="module")
def report_and_thresholds(models):
    """The report, and the threshold of every request any section submitted to an engine."""
    thresholds = set()
    validate = DecodeParams.validate

    def recording(params, max_block_size):
        thresholds.add(params.threshold)
        return validate(params, max_block_size)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeParams, "validate", recording)
        return run_bench(models, OPTIONS), thresholds


@pytest.fixture(scope="module")
def report(report_and_thresholds):
    return report_and_thresholds[0]


def test_every_section_decodes_at_the_benchs_threshold(report_and_thresholds):
    # tasks, block sizes, structured, serving (through the server) and decisions at 0.6; the threshold
    # sweep adds its own values; DecodeParams' default never appears
    _, thresholds = report_and_thresholds
    assert thresholds == {0.6, 0.95} and DecodeParams.threshold not in thresholds


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_has_exactly_the_documented_fields_and_consistent_values(report):
    assert set(report) == {"tasks", "median_exec_s", "context_scaling", "schema", "block_sizes", "thresholds", "structured", "serving", "decisions", "meta"}
    assert list(report["tasks"]) == ["arithmetic", "kv_retrieval"]
    # kv_retrieval publishes an answer schema, arithmetic none: only the first decodes under a grammar
    assert [entry["constrained"] for entry in report["tasks"].values()] == [False, True]
    for entry in report["tasks"].values():
        assert set(entry) == TASK_FIELDS
        assert set(entry["clover"]) == CLOVER_FIELDS and set(entry["peer"]) == PEER_FIELDS
        assert set(entry["clover_b1"]) == CLOVER_FIELDS
        assert entry["llama_cpp"] is None  # not loaded here
        for model in ("clover", "clover_b1", "peer"):
            assert entry[model]["wall_s_median"] > 0 and entry[model]["tokens_per_s"] > 0
        assert 0 < entry["clover"]["tpf"] <= OPTIONS.block_size
        clover_wall = entry["clover"]["wall_s_median"]
        assert entry["speedup"] == pytest.approx(entry["peer"]["wall_s_median"] / clover_wall, rel=1e-2, abs=RATIO_ROUNDING)
        assert set(entry["speedup_vs"]) == {"clover_b1", "peer", "peer_lookup", "llama_cpp"}
        assert entry["speedup_vs"]["llama_cpp"] is None
    free, constrained = report["tasks"]["arithmetic"], report["tasks"]["kv_retrieval"]
    assert free["clover_b1"]["tpf"] == pytest.approx(1.0, abs=1e-3)  # one token a forward
    # at block size 1 every token, forced or not, still needs the forward that commits it to the cache
    assert 0 < constrained["clover_b1"]["tpf"] <= 1.0 + 1e-3
    # greedy either way: prompt lookup changes the peer's forwards, never its answers; under a grammar the
    # peer drafts by jump-forward instead, and peer_lookup does not run
    assert set(free["peer_lookup"]) == PEER_FIELDS and free["peer_lookup"]["accuracy"] == free["peer"]["accuracy"]
    assert free["speedup_vs"]["peer_lookup"] == pytest.approx(free["peer_lookup"]["wall_s_median"] / free["clover"]["wall_s_median"], rel=1e-2, abs=RATIO_ROUNDING)
    assert constrained["peer_lookup"] is None and constrained["speedup_vs"]["peer_lookup"] is None
    assert set(report["median_exec_s"]) == {"clover", "clover_b1", "peer", "peer_lookup", "llama_cpp"}
    assert report["median_exec_s"]["llama_cpp"] is None
    assert all(report["median_exec_s"][name] > 0 for name in ("clover", "clover_b1", "peer", "peer_lookup"))

    schema = report["schema"]
    assert set(schema) == {"clover_free", "clover_schema", "clover_grounded", "peer_schema", "peer_grounded", "schema_cost_per_forward",
                           "tpf_gain", "speedup", "speedup_grounded", "grounded_gain", "prompts", "messages"}
    assert (schema["prompts"], schema["messages"]) == (2, 2)
    for name in ("clover_free", "clover_schema", "clover_grounded", "peer_schema", "peer_grounded"):
        assert set(schema[name]) == SCHEMA_FIELDS and schema[name]["ms_per_forward"] > 0
    assert set(schema["grounded_gain"]) == {"clover", "peer"} and set(schema["grounded_gain"]["peer"]) == {"zone_exact", "tpf"}
    # under the grammar every answer that is not cut at the budget parses and validates
    for name in ("clover_schema", "clover_grounded", "peer_schema", "peer_grounded"):
        assert schema[name]["parsed"] == schema[name]["schema_valid"] == 1 - schema[name]["truncated"]
        assert 0 < schema[name]["forced_share"] < 1
        assert 0 < schema[name]["grammar_ms_per_forward"] < schema[name]["ms_per_forward"]
    assert schema["clover_free"]["forced_share"] is None and schema["clover_free"]["grammar_ms_per_forward"] is None
    assert schema["clover_free"]["refused"] is None and set(schema["clover_schema"]["refused"]) == {"guard", "budget"}
    assert schema["schema_cost_per_forward"] == pytest.approx(
        1 + schema["clover_schema"]["grammar_ms_per_forward"] / schema["clover_free"]["ms_per_forward"], rel=1e-2
    )
    assert schema["speedup"] == pytest.approx(schema["peer_schema"]["wall_s_median"] / schema["clover_schema"]["wall_s_median"], rel=1e-2, abs=RATIO_ROUNDING)

    assert [row["context"] for row in report["context_scaling"]] == [64, 128]
    tpfs = [entry["clover"]["tpf"] for entry in report["tasks"].values()]
    for row in report["context_scaling"]:
        assert set(row) == CONTEXT_FIELDS
        assert row["clover_block_ms"] > 0 and row["memory_only_block_ms"] > 0 and row["peer_token_ms"] > 0
        # the TPF over all task requests: between the tasks' TPFs (up to their rounding)
        assert min(tpfs) - 1e-3 <= row["block_tokens"] <= max(tpfs) + 1e-3
        expected = row["peer_token_ms"] * row["block_tokens"] / row["clover_block_ms"]
        assert row["speedup"] == pytest.approx(expected, rel=1e-2, abs=RATIO_ROUNDING)
        assert row["hybrid_block_ms"] > 0
        assert row["hybrid_vs_clover"] == pytest.approx(row["hybrid_block_ms"] / row["clover_block_ms"], rel=1e-2, abs=RATIO_ROUNDING)
        assert all(row[f"{name}_cache_bytes"] > 0 for name in ("clover", "memory_only", "hybrid", "peer"))

    assert [(row["block_size"], row["threshold"]) for row in report["block_sizes"]] == [(4, 0.6), (16, 0.6)]
    assert [(row["block_size"], row["threshold"]) for row in report["thresholds"]] == [(OPTIONS.block_size, 0.6), (OPTIONS.block_size, 0.95)]
    for row in report["block_sizes"] + report["thresholds"]:
        assert set(row) == SWEEP_FIELDS
        assert 0 < row["tpf"] <= row["block_size"] and row["tokens_per_s"] > 0
    # both sweeps decode the same prompts at (16, 0.6): the same tokens, so the same TPF and accuracy
    same = lambda row: (row["tpf"], row["accuracy"])  # noqa: E731
    assert same(report["block_sizes"][1]) == same(report["thresholds"][0])
    for mode in ("free", "grammar"):
        assert report["structured"][mode]["tpf"] > 0
    for load in ("single", "concurrent"):
        assert report["serving"][load]["failed"] == 0 and report["serving"][load]["latency_p99_s"] > 0
    assert report["serving"]["concurrent"]["ok"] == 2
    assert report["decisions"]["joint_distinct"]["no_overlap"] == 1.0
    meta = report["meta"]
    assert meta["repeats"] == 2 and meta["torch_threads"] == 1 and meta["dtype"] == "float32"
    assert meta["models"]["peer"] == "tiny-peer"


def test_write_report_writes_the_json_and_five_plots(report, tmp_path):
    paths = write_report(report, tmp_path / "out" / "bench.json")
    names = ["bench.json", "bench_tasks.png", "bench_context.png", "bench_schema.png", "bench_block_sizes.png", "bench_thresholds.png"]
    assert [path.name for path in paths] == names
    assert json.loads(paths[0].read_text()) == report
    for path in paths[1:]:
        width, height = png_size(path)
        assert width >= 600 and height >= 400
        assert path.stat().st_size > 10_000  # axes, bars, labels: not a blank canvas


def test_without_a_peer_its_fields_are_null(models, tmp_path):
    options = BenchOptions(
        tasks=("arithmetic",), prompts=1, repeats=1, contexts=(64,), timed_forwards=1,
        sweep_task="arithmetic", sweep_prompts=1, sweep_block_sizes=(8,), sweep_thresholds=(0.9,),
        schema_prompts=1, schema_messages=1, structured_prompts=1, load_clients=1, load_requests=1, decision_prompts=1,
    )  # fmt: skip
    clover_only = BenchModels(models.clover, models.memory_only, None, models.tokenizer, {"clover": "tiny"})
    report = run_bench(clover_only, options)
    entry = report["tasks"]["arithmetic"]
    assert entry["peer"] == dict.fromkeys(PEER_FIELDS) and entry["speedup"] is None
    assert set(entry["clover"]) == CLOVER_FIELDS and entry["clover"]["wall_s_median"] > 0
    assert report["median_exec_s"]["peer"] is None and report["median_exec_s"]["clover"] > 0
    (row,) = report["context_scaling"]
    assert row["peer_token_ms"] is None and row["speedup"] is None and row["clover_block_ms"] > 0
    assert row["peer_cache_bytes"] is None and row["clover_cache_bytes"] > 0
    # no hybrid either: its fields are there, null
    assert set(row) == CONTEXT_FIELDS and row["hybrid_block_ms"] is None and row["hybrid_vs_clover"] is None and row["hybrid_cache_bytes"] is None
    assert report["schema"]["peer_schema"] is None and report["schema"]["speedup"] is None
    for path in write_report(report, tmp_path / "bench.json")[1:]:
        assert png_size(path)[0] >= 600


def test_block_size_sweep_adds_auto_for_a_calibrated_model(models, report, tmp_path):
    assert "auto" not in [row["block_size"] for row in report["block_sizes"]]  # no calibration
    hidden = models.clover.config.hidden_size
    # a head predicting one step at every size: auto takes the size fastest per token (16)
    calibration = Calibration(
        block_sizes=[4, 16], threshold=0.9, forward_ms=[1.0, 2.0], weight=torch.zeros(2, hidden), bias=torch.zeros(2)
    )
    rows = bench_block_sizes(dataclasses.replace(models, calibration=calibration), OPTIONS)
    assert [row["block_size"] for row in rows] == [4, 16, "auto"]
    assert 0 < rows[-1]["tpf"] <= 16
    # the head only picks sizes for "auto": the fixed sizes decode as without a calibration
    assert [(row["tpf"], row["accuracy"]) for row in rows[:2]] == [(row["tpf"], row["accuracy"]) for row in report["block_sizes"]]
    path = write_report({**report, "block_sizes": rows}, tmp_path / "auto.json")[3]
    assert png_size(path)[0] >= 600


def test_accuracy_uses_each_tasks_checker_field(tokenizer):
    for task in ("no_fly_zones", "arithmetic"):
        (example,) = heldout_examples(tokenizer, task, 1, 1 << 30)
        answer = example.ids[example.prompt_length : -2]  # without <|im_end|> and end of text
        assert accuracy(task, example, answer, tokenizer) == 1.0
        assert accuracy(task, example, tokenizer("nothing useful")["input_ids"], tokenizer) == 0.0
    # no_fly_zones counts zones: dropping the last zone of the list keeps the others right
    (example,) = heldout_examples(tokenizer, "no_fly_zones", 1, 1 << 30)
    zones = json.loads(example.example.answer)
    partial = tokenizer(json.dumps(zones[:-1]))["input_ids"]
    score = accuracy("no_fly_zones", example, partial, tokenizer)
    assert score == pytest.approx((len(zones) - 1) / len(zones))


def test_spread_parse_and_option_errors():
    assert spread_prompts(49, 4) == [13, 12, 12, 12] and sum(spread_prompts(49, 4)) == 49
    assert spread_prompts(4, 4) == [1, 1, 1, 1]
    assert [parse_context(text) for text in ("1k", "64K", "300")] == [1024, 65536, 300]
    for bad in ("", "k", "-4k", "4m", "0"):
        with pytest.raises(CloverError, match="positive token count"):
            parse_context(bad)
    with pytest.raises(CloverError, match="cannot cover 4 tasks"):
        BenchOptions(prompts=3).validate()
    assert BenchOptions.quick(repeats=2).repeats == 2 and BenchOptions.quick().contexts == (1024, 4096)
    with pytest.raises(CloverError, match=r"unknown bench sections \['schemas'\]: choose from tasks, context_scaling, schema"):
        BenchOptions(sections=("schemas",)).validate()
    with pytest.raises(CloverError, match="context_scaling section needs the tasks section"):
        BenchOptions(sections=("context_scaling",)).validate()


def test_sections_run_only_what_is_asked_and_free_decodes_without_grammars(models, tmp_path):
    report = run_bench(models, dataclasses.replace(OPTIONS, sections=("tasks", "schema"), answers="free", repeats=1))
    assert set(report) == {"tasks", "median_exec_s", "schema", "meta"}
    assert [entry["constrained"] for entry in report["tasks"].values()] == [False, False]
    entry = report["tasks"]["kv_retrieval"]  # free: the peer with prompt lookup runs here too
    assert set(entry["peer_lookup"]) == PEER_FIELDS and entry["peer_lookup"]["accuracy"] == entry["peer"]["accuracy"]
    paths = write_report(report, tmp_path / "bench.json")
    assert [path.name for path in paths] == ["bench.json", "bench_tasks.png", "bench_schema.png"]


def test_llama_cpp_without_the_package_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what an environment without the extra sees
    with pytest.raises(CloverError) as raised:
        load_llama_cpp(tmp_path / "base.gguf", threads=1)
    assert str(raised.value) == 'llama.cpp peer needs llama-cpp-python: pip install -e ".[llama]" (compiles for minutes)'


def test_cli_without_a_peer_folder_says_how_to_train_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["bench", "--peer", str(tmp_path / "missing")])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: no peer model at {tmp_path / 'missing'}") and error.count("\n") == 1
    assert "clover train --recipe convert --arch ar" in error and "--no-peer" in error


@pytest.mark.slow
def test_cli_quick_run_on_saved_tiny_models(models, tokenizer, tmp_path, capsys):
    save_model(models.clover, tokenizer, tmp_path / "clover")
    save_model(models.memory_only, tokenizer, tmp_path / "memory")
    save_peer(models.peer, tokenizer, tmp_path / "peer")
    save_model(models.hybrid, tokenizer, tmp_path / "hybrid")
    main([
        "bench", "--model", str(tmp_path / "clover"), "--memory-model", str(tmp_path / "memory"),
        "--peer", str(tmp_path / "peer"), "--hybrid", str(tmp_path / "hybrid"), "--quick", "--contexts", "64", "128", "--threads", "1",
        "--json", str(tmp_path / "report" / "quick.json"),
    ])  # fmt: skip
    report = json.loads((tmp_path / "report" / "quick.json").read_text())
    assert report["meta"]["models"]["hybrid"] == str(tmp_path / "hybrid")
    for row in report["context_scaling"]:
        assert row["hybrid_block_ms"] > 0 and row["hybrid_cache_bytes"] > 0 and row["hybrid_vs_clover"] > 0
    assert list(report["tasks"]) == ["no_fly_zones", "tool_call", "kv_retrieval", "arithmetic"]
    assert report["meta"]["repeats"] == 1 and report["meta"]["prompts"] == 4
    assert [row["block_size"] for row in report["block_sizes"]] == [4, 16, 64]
    walls = [entry[model]["wall_s_median"] for entry in report["tasks"].values() for model in ("clover", "peer")]
    assert all(wall > 0 for wall in walls)
    # one prompt per task: the median over requests is the median of the per-task walls
    for model in ("clover", "peer"):
        per_task = [entry[model]["wall_s_median"] for entry in report["tasks"].values()]
        assert report["median_exec_s"][model] == pytest.approx(statistics.median(per_task), rel=1e-3)
    for suffix in ("tasks", "context", "schema", "block_sizes", "thresholds"):
        assert (tmp_path / "report" / f"quick_{suffix}.png").stat().st_size > 10_000
