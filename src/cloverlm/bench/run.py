"""`clover bench`: Clover against its autoregressive peer, in one process, on the same prompts.

Each section is one function and one key of the JSON report:

* `tasks` and `median_exec_s` (bench_tasks): held-out prompts spread over the tasks (49 by default,
  the 49-task view), decoded one request at a time (batch 1: latency). After a warm-up request per
  model, Clover and the peer alternate request by request, so drift in the machine's speed hits both
  alike; every request runs `repeats` times and its wall time is the median of its runs. Per task:
  accuracy by the task's checker (the mean of its "exact" field; "zone_exact_match" for no_fly_zones),
  the median wall time per request, tokens/s (generated tokens / wall seconds, summed over the task's
  requests) and Clover's tokens per forward (TPF). speedup = peer wall_s_median / Clover wall_s_median.
  median_exec_s: each model's median wall time over all requests.
* `context_scaling` (bench_context): the cost of one decoding forward after a context of random
  tokens. Clover's forwards are block forwards; a block of B tokens takes B / TPF of them (TPF as
  measured in the tasks section): the first commits the previous block fused with a denoising step,
  the others only denoise. So
    - clover_block_ms = (fused_ms + (B / TPF - 1) * step_ms) / (B / TPF): one block forward in the
      engine's mix, median over timed forwards; memory_only_block_ms: the same for the memory-only
      model (same mix, so the two compare the architectures' cost per forward);
    - block_tokens = TPF: the tokens one Clover block forward yields;
    - peer_token_ms: one cached one-token forward of the peer;
    - speedup = peer_token_ms * block_tokens / clover_block_ms: the peer's time to produce the tokens
      one Clover block forward yields, over the time of that forward.
  Timed fused forwards each commit one more block, so the context grows by a few blocks while timing.
* `block_sizes` (bench_block_sizes): Clover's TPF and accuracy at fixed block sizes on one task, and
  at block_size "auto" when the Clover folder holds a calibration (`clover calibrate`);
  `thresholds` (bench_thresholds): the same at the bench's block size per confidence threshold.
* `structured` and `serving` (`cloverlm.bench.serving`): TPF with a tool-call grammar next to TPF
  without; the load test (concurrent clients against `clover serve` on loopback, against one client).
* `decisions` (`cloverlm.bench.decisions`): drone_slots puzzles answered one at a time, jointly,
  and jointly with distinct answers: the rate of mutually consistent answer sets, and wall time.

write_report writes the JSON and, next to it, `<stem>_tasks.png`, `<stem>_context.png` and
`<stem>_block_sizes.png` and `<stem>_thresholds.png`. Without a peer its fields are null and its plot series are left out.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedTokenizerFast
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

from cloverlm import tasks
from cloverlm.bench.decisions import bench_decisions
from cloverlm.bench.llama_cpp import llama_cpp_generate, load_llama_cpp
from cloverlm.bench.serving import bench_load, bench_structured
from cloverlm.convert.load import load_model
from cloverlm.convert.peer import PEER_ARCH, is_peer_folder, load_peer, peer_generate
from cloverlm.decoding.calibration import Calibration, load_calibration
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import AUTO, DecodeParams, Request
from cloverlm.errors import CloverError
from cloverlm.model.cache import CloverCache
from cloverlm.model.checkpoint import inference_dtype
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.config import ATTENTION
from cloverlm.model.layout import fixed_partition
from cloverlm.tokenizer import SPECIAL_TOKENS, load_tokenizer, stop_token_ids
from cloverlm.training.data import TokenizedExample, heldout_examples
from cloverlm.training.evaluate import answer_budget

TASK_NAMES = tasks.SUITE
# The checker field a task is scored by; "exact" unless named here. A no_fly_zones answer lists many
# zones: the share of zones exactly right separates models that an all-or-nothing "exact" does not.
ACCURACY_FIELDS = {"no_fly_zones": "zone_exact_match"}
# Clover's parallel prefill builds a context x context attention mask (and scores) in its attention
# layers: past this many tokens the rest of a long context is committed block by block instead.
PREFILL_LIMIT = 8192
PEER_PIECE = 2048  # the peer reads a long context in forwards of this many tokens
PEER_FIELDS = ("accuracy", "wall_s_median", "tokens_per_s")
# Who the tasks section times, with their plot labels: Clover at the bench's block size, (d) Clover at
# block size 1, (a) the AR peer with transformers' generate, (b) the same with prompt lookup, (c)
# llama.cpp on the base's GGUF.
RUNNER_LABELS = {
    "clover": "Clover", "clover_b1": "Clover, block size 1", "peer": "peer: generate",
    "peer_lookup": "peer: generate + prompt lookup", "llama_cpp": "llama.cpp (base GGUF)",
}
RUNNERS = tuple(RUNNER_LABELS)


@dataclass
class BenchOptions:
    tasks: tuple[str, ...] = TASK_NAMES
    prompts: int = 49  # held-out prompts, spread over the tasks
    repeats: int = 3  # timed runs of each request (medians reported)
    block_size: int = DecodeParams.block_size
    threshold: float = DecodeParams.threshold
    draft: bool = False  # Clover fills blocks with prompt-lookup drafts (all-attention models)
    peer_lookup: int = 10  # peer (b): transformers' prompt_lookup_num_tokens
    contexts: tuple[int, ...] = (1024, 4096, 16384, 65536)
    timed_forwards: int = 10  # per context-scaling measurement (median reported)
    sweep_task: str = "no_fly_zones"
    sweep_prompts: int = 4
    sweep_block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)
    sweep_thresholds: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9, 0.95)
    structured_prompts: int = 8  # tool_call prompts decoded free and under the grammar
    load_clients: int = 32  # the serving load test: concurrent clients x requests each
    load_requests: int = 10
    decision_prompts: int = 8  # drone_slots puzzles answered jointly and one at a time

    @classmethod
    def quick(cls, **overrides) -> BenchOptions:
        """A run of under 3 minutes on a 2-core CPU: one prompt per task, one repeat, short contexts."""
        fast = dict(prompts=4, repeats=1, contexts=(1024, 4096), timed_forwards=5, sweep_prompts=1, sweep_block_sizes=(4, 16, 64),
                    sweep_thresholds=(0.5, 0.9),
                    structured_prompts=2, load_clients=4, load_requests=2, decision_prompts=2)
        return cls(**{**fast, **overrides})

    def validate(self) -> None:
        if self.prompts < len(self.tasks):
            raise CloverError(f"{self.prompts} prompts cannot cover {len(self.tasks)} tasks: give at least one per task")
        for name in ("repeats", "timed_forwards", "sweep_prompts"):
            if getattr(self, name) < 1:
                raise CloverError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.contexts or min(self.contexts) < 1:
            raise CloverError(f"contexts must be positive token counts, got {list(self.contexts)}")


@dataclass
class BenchModels:
    clover: CloverForBlockDiffusion
    memory_only: CloverForBlockDiffusion
    peer: Qwen3_5MoeForCausalLM | None
    tokenizer: PreTrainedTokenizerFast  # Clover's; the peer must share it (same prompts, same ids)
    folders: dict[str, str | None]  # where each model came from, for the report
    calibration: Calibration | None = None  # Clover's block-size head: adds "auto" to the block-size sweep
    llama: object | None = None  # a llama_cpp.Llama on the base's GGUF (cloverlm.bench.llama_cpp), or None


def parse_context(text: str) -> int:
    """A context length: "4096", or with a k suffix, "4k" = 4096."""
    digits, kilo = (text[:-1], 1024) if text.lower().endswith("k") else (text, 1)
    if not digits.isdigit() or int(digits) < 1:
        raise CloverError(f"a context is a positive token count like 4096 or 4k, got '{text}'")
    return int(digits) * kilo


def load_models(clover_dir: Path, memory_dir: Path, peer_dir: Path | None, llama_gguf: Path | None = None) -> BenchModels:
    """Load the models (no peer when peer_dir is None, no llama.cpp without a GGUF), in the dtype this
    machine decodes fastest in; the peer is checked first, it is the one most likely missing."""
    if peer_dir is not None and not is_peer_folder(peer_dir):
        raise CloverError(
            f"no peer model at {peer_dir}: train one with `clover train --recipe convert --arch ar --out runs/convert-peer` "
            f"(a converted base; `clover train --arch {PEER_ARCH}` for a from-scratch Clover) and pass --peer, or run with --no-peer"
        )
    tokenizer = load_tokenizer(clover_dir)
    dtype = inference_dtype()
    peer = None
    if peer_dir is not None:
        peer = load_peer(peer_dir, dtype)
        if (peer_dir / "tokenizer.json").is_file() and load_tokenizer(peer_dir).get_vocab() != tokenizer.get_vocab():
            raise CloverError(f"the peer at {peer_dir} uses another tokenizer than {clover_dir}: the prompts would differ")
    return BenchModels(
        clover=load_model(clover_dir, dtype),
        memory_only=load_model(memory_dir, dtype),
        peer=peer,
        tokenizer=tokenizer,
        calibration=load_calibration(clover_dir),
        folders={"clover": str(clover_dir), "memory_only": str(memory_dir), "peer": None if peer_dir is None else str(peer_dir),
                 "llama_cpp": None if llama_gguf is None else str(llama_gguf)},
        llama=None if llama_gguf is None else load_llama_cpp(llama_gguf, torch.get_num_threads()),
    )


def run_bench(models: BenchModels, options: BenchOptions) -> dict:
    """All sections, in the JSON shape documented above, plus "meta"."""
    options.validate()
    task_report, median_exec_s, tpf = bench_tasks(models, options)
    return {
        "tasks": task_report,
        "median_exec_s": median_exec_s,
        "context_scaling": bench_context(models, options, tpf),
        "block_sizes": bench_block_sizes(models, options),
        "thresholds": bench_thresholds(models, options),
        "structured": bench_structured(models.clover, models.tokenizer, options.structured_prompts, options.block_size, options.threshold),
        "serving": bench_load(models.clover, models.tokenizer, options.load_clients, options.load_requests,
                              block_size=options.block_size, threshold=options.threshold),
        "decisions": bench_decisions(models.clover, models.tokenizer, options.decision_prompts, threshold=options.threshold),
        "meta": {
            "models": models.folders,
            "torch_threads": torch.get_num_threads(),
            "dtype": str(next(models.clover.parameters()).dtype).removeprefix("torch."),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            # lists, not tuples: the report reads back from its JSON unchanged
            **{key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(options).items()},
        },
    }


# ----------------------------------------------------------------------------------------------
# Tasks: accuracy and latency per request


def spread_prompts(total: int, task_count: int) -> list[int]:
    """Prompts per task, as even as possible, the first tasks taking the remainder (49 over 4: 13, 12, 12, 12)."""
    base, extra = divmod(total, task_count)
    return [base + (index < extra) for index in range(task_count)]


def accuracy(task: str, example: TokenizedExample, tokens: list[int], tokenizer) -> float:
    scores = tasks.get_task(task).check(example.example, tokenizer.decode(tokens))
    return scores[ACCURACY_FIELDS.get(task, "exact")]


def _prompt_ids(example: TokenizedExample) -> list[int]:
    return example.ids[: example.prompt_length]


def _clover_params(example: TokenizedExample, options: BenchOptions, tokenizer, block_size: int | str) -> DecodeParams:
    return DecodeParams(
        max_new_tokens=answer_budget(example),
        block_size=block_size,
        threshold=options.threshold,
        draft=options.draft and block_size != 1,
        stop_token_ids=stop_token_ids(tokenizer),
    )


@dataclass
class _Measured:
    """One prompt's results for one model: the first run's tokens (greedy: every run decodes the same)
    and the wall time of every run."""

    tokens: list[int]
    forwards: int
    walls: list[float]

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)


def bench_tasks(models: BenchModels, options: BenchOptions) -> tuple[dict, dict, float]:
    """Returns (the "tasks" report, "median_exec_s", Clover's TPF over all requests)."""
    tokenizer = models.tokenizer
    counts = spread_prompts(options.prompts, len(options.tasks))
    prompts = [
        (task, example)
        for task, count in zip(options.tasks, counts)
        for example in heldout_examples(tokenizer, task, count, 1 << 30)
    ]
    engine = Engine(models.clover, max_batch_size=1)
    stops = stop_token_ids(tokenizer)

    def clover(block_size: int) -> Callable:
        def run(example: TokenizedExample) -> tuple[list[int], int]:
            params = _clover_params(example, options, tokenizer, block_size)
            completion = engine.generate([Request(_prompt_ids(example), params)])[0]
            return completion.tokens, completion.forwards
        return run

    def peer(prompt_lookup: int) -> Callable:
        def run(example: TokenizedExample) -> tuple[list[int], int]:
            tokens = peer_generate(models.peer, _prompt_ids(example), answer_budget(example), stops, prompt_lookup)
            return tokens, len(tokens)  # forwards: only Clover's are reported
        return run

    def llama_cpp(example: TokenizedExample) -> tuple[list[int], int]:
        tokens = llama_cpp_generate(models.llama, _prompt_ids(example), answer_budget(example), stops)
        return tokens, len(tokens)

    runners: dict[str, Callable] = {"clover": clover(options.block_size), "clover_b1": clover(1)}
    if models.peer is not None:
        runners["peer"] = peer(0)
        runners["peer_lookup"] = peer(options.peer_lookup)
    if models.llama is not None:
        runners["llama_cpp"] = llama_cpp
    shortest = min((example for _, example in prompts), key=lambda example: len(example.ids))
    for run in runners.values():
        run(shortest)  # warm-up: one-time allocations and lazy initialisation stay out of the timings
    measured: dict[str, list[_Measured]] = {name: [] for name in runners}
    with tqdm(total=options.repeats * len(prompts) * len(runners), desc="tasks") as bar:
        for repeat in range(options.repeats):
            for index, (_, example) in enumerate(prompts):
                for name, run in runners.items():
                    started = time.perf_counter()
                    tokens, forwards = run(example)
                    wall = time.perf_counter() - started
                    if repeat == 0:
                        measured[name].append(_Measured(tokens, forwards, []))
                    measured[name][index].walls.append(wall)
                    bar.update()

    def summary(name: str, task: str) -> dict:
        rows = [(example, m) for (t, example), m in zip(prompts, measured[name]) if t == task]
        walls = [m.wall for _, m in rows]
        tokens = sum(len(m.tokens) for _, m in rows)
        result = {
            "accuracy": round(statistics.mean(accuracy(task, example, m.tokens, tokenizer) for example, m in rows), 4),
            "wall_s_median": round(statistics.median(walls), 5),
            "tokens_per_s": round(tokens / sum(walls), 2),
        }
        if name.startswith("clover"):
            result["tpf"] = round(tokens / sum(m.forwards for _, m in rows), 3)
        return result

    report = {}
    for task in options.tasks:
        entry = {name: summary(name, task) if name in measured else None for name in RUNNERS}
        entry["peer"] = entry["peer"] or dict.fromkeys(PEER_FIELDS)
        clover_wall = entry["clover"]["wall_s_median"]
        entry["speedup"] = _ratio(entry["peer"]["wall_s_median"], clover_wall)
        # Clover's speedup over each other runner: its median wall time over Clover's
        entry["speedup_vs"] = {
            name: _ratio(entry[name]["wall_s_median"], clover_wall) if entry[name] else None for name in RUNNERS[1:]
        }
        report[task] = entry
    median_exec_s = {
        name: round(statistics.median(m.wall for m in measured[name]), 5) if name in measured else None
        for name in RUNNERS
    }
    all_clover = measured["clover"]
    tpf = sum(len(m.tokens) for m in all_clover) / sum(m.forwards for m in all_clover)
    return report, median_exec_s, tpf


def _ratio(numerator: float | None, denominator: float) -> float | None:
    return None if numerator is None else round(numerator / denominator, 3)


# ----------------------------------------------------------------------------------------------
# Context scaling: the cost of one forward after a long context


def _random_ids(vocab_size: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """[1, count] ordinary tokens (no special ones: a [MASK] must not be committed)."""
    return torch.randint(len(SPECIAL_TOKENS), vocab_size, (1, count), generator=generator)


def _median_ms(forward: Callable[[], object], count: int) -> float:
    forward()  # warm-up; for Clover's fused forward also the one-time growth of the attention cache
    times = []
    for _ in range(count):
        started = time.perf_counter()
        forward()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


@torch.no_grad()
def _filled_cache(model: CloverForBlockDiffusion, context: int) -> CloverCache:
    """A one-row cache holding `context` committed random tokens."""
    config = model.config
    ids = _random_ids(config.vocab_size, context, torch.Generator().manual_seed(context))
    parallel = min(context, PREFILL_LIMIT) if ATTENTION in config.layer_types else context
    size = config.max_block_size
    blocks = fixed_partition(parallel, size)
    cache = CloverCache.empty(config, 1)
    model.prefill(ids[:, :parallel], blocks, cache)
    for start in tqdm(range(parallel, context, size), desc=f"commit {context} tokens", leave=False, disable=parallel == context):
        model.decode(cache, commit_ids=ids[:, start : start + size])
    return cache


@torch.no_grad()
def _clover_block_ms(model: CloverForBlockDiffusion, context: int, block_size: int, forwards_per_block: float, count: int) -> float:
    cache = _filled_cache(model, context)
    masked = torch.full((1, block_size), model.config.mask_token_id)
    clean = _random_ids(model.config.vocab_size, block_size, torch.Generator().manual_seed(0))
    step_ms = _median_ms(lambda: model.decode(cache, step_ids=masked), count)
    fused_ms = _median_ms(lambda: model.decode(cache, commit_ids=clean, step_ids=masked), count)
    return (fused_ms + (forwards_per_block - 1) * step_ms) / forwards_per_block


@torch.no_grad()
def _peer_token_ms(peer: Qwen3_5MoeForCausalLM, context: int, count: int) -> float:
    ids = _random_ids(peer.config.vocab_size, context, torch.Generator().manual_seed(context))
    cache = DynamicCache(config=peer.config)
    for start in range(0, context, PEER_PIECE):
        peer(ids[:, start : start + PEER_PIECE], cache=cache, use_cache=True, logits_to_keep=1)
    token = ids[:, -1:]
    return _median_ms(lambda: peer(token, cache=cache, use_cache=True), count)


def bench_context(models: BenchModels, options: BenchOptions, tpf: float) -> list[dict]:
    """One row per context; the fields are defined in the module docstring."""
    forwards_per_block = max(options.block_size / tpf, 1.0)
    block_tokens = round(tpf, 3)
    rows = []
    for context in tqdm(options.contexts, desc="contexts"):
        clover_ms, memory_ms = (
            round(_clover_block_ms(model, context, options.block_size, forwards_per_block, options.timed_forwards), 3)
            for model in (models.clover, models.memory_only)
        )
        peer_ms = None if models.peer is None else round(_peer_token_ms(models.peer, context, options.timed_forwards), 3)
        rows.append(
            {
                "context": context,
                "clover_block_ms": clover_ms,
                "memory_only_block_ms": memory_ms,
                "block_tokens": block_tokens,
                "peer_token_ms": peer_ms,
                "speedup": _ratio(None if peer_ms is None else peer_ms * block_tokens, clover_ms),
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Block-size sweep


def bench_block_sizes(models: BenchModels, options: BenchOptions) -> list[dict]:
    """Clover's TPF and accuracy per block size at the bench's threshold, plus "auto" when calibrated."""
    block_sizes: list[int | str] = list(options.sweep_block_sizes)
    if models.calibration is not None:
        block_sizes.append(AUTO)
    else:
        note = f"block-size sweep without {AUTO!r}: {models.folders.get('clover')} has no calibration (clover calibrate)"
        tqdm.write(note, file=sys.stderr)
    return _sweep(models, options, [(size, options.threshold) for size in block_sizes], "block sizes")


def bench_thresholds(models: BenchModels, options: BenchOptions) -> list[dict]:
    """Clover's TPF and accuracy per confidence threshold at the bench's block size."""
    return _sweep(models, options, [(options.block_size, threshold) for threshold in options.sweep_thresholds], "thresholds")


def _sweep(models: BenchModels, options: BenchOptions, settings: list[tuple[int | str, float]], desc: str) -> list[dict]:
    """One row per (block size, threshold): the sweep prompts decoded as one batch. Only tokens and
    forwards are compared here (a batched request decodes as it would alone); tokens_per_s is the
    batch's throughput, not a latency."""
    tokenizer = models.tokenizer
    examples = heldout_examples(tokenizer, options.sweep_task, options.sweep_prompts, 1 << 30)
    rows = []
    for block_size, threshold in tqdm(settings, desc=f"{desc} ({options.sweep_task})"):
        params = [dataclasses.replace(_clover_params(e, options, tokenizer, block_size), threshold=threshold) for e in examples]
        engine = Engine(models.clover, max_batch_size=len(examples), calibration=models.calibration)
        start = time.perf_counter()
        completions = engine.generate([Request(_prompt_ids(e), p) for e, p in zip(examples, params)])
        seconds = time.perf_counter() - start
        tokens = sum(len(completion.tokens) for completion in completions)
        scores = [accuracy(options.sweep_task, e, c.tokens, tokenizer) for e, c in zip(examples, completions)]
        rows.append(
            {
                "block_size": block_size,
                "threshold": threshold,
                "tpf": round(tokens / sum(completion.forwards for completion in completions), 3),
                "tokens_per_s": round(tokens / seconds, 2),
                "accuracy": round(statistics.mean(scores), 4),
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Report: JSON and plots


def write_report(report: dict, json_path: Path) -> list[Path]:
    """The JSON at json_path and the three plots next to it; returns the paths written."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plots = {"tasks": _plot_tasks, "context": _plot_context, "block_sizes": _plot_block_sizes, "thresholds": _plot_thresholds}
    paths = [json_path]
    for suffix, plot in plots.items():
        figure = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        plot(figure.add_subplot(), report)
        path = json_path.with_name(f"{json_path.stem}_{suffix}.png")
        figure.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _plot_tasks(axes, report: dict) -> None:
    names = list(report["tasks"])
    shown = [r for r in RUNNERS if all(report["tasks"][t].get(r) and report["tasks"][t][r]["wall_s_median"] for t in names)]
    width = 0.8 / len(shown)
    for offset, runner in enumerate(shown):
        walls = [report["tasks"][t][runner]["wall_s_median"] for t in names]
        axes.bar([x - 0.4 + width * (offset + 0.5) for x in range(len(names))], walls, width=width, label=RUNNER_LABELS[runner])
    if "peer" in shown:
        for x, name in enumerate(names):
            top = max(report["tasks"][name][r]["wall_s_median"] for r in shown)
            axes.annotate(f"{report['tasks'][name]['speedup']:.2f}x", (x, top), ha="center", va="bottom")
    axes.set_xticks(list(range(len(names))), names)
    axes.set_yscale("log")  # answers range from a few tokens to hundreds
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.yaxis.set_major_formatter(plain)
    axes.yaxis.set_minor_formatter(plain)
    axes.set_ylabel("median wall seconds per request")
    axes.set_title("Latency per request (batch 1); labels: speedup = peer / Clover")
    axes.legend(fontsize="small")


def _plot_context(axes, report: dict) -> None:
    rows = report["context_scaling"]
    contexts = [row["context"] for row in rows]
    axes.plot(contexts, [row["clover_block_ms"] for row in rows], "o-", label="Clover, per block forward")
    axes.plot(contexts, [row["memory_only_block_ms"] for row in rows], "s-", label="Clover memory-only, per block forward")
    if rows and rows[0]["peer_token_ms"] is not None:
        axes.plot(
            contexts,
            [row["peer_token_ms"] * row["block_tokens"] for row in rows],
            "^-",
            label="peer, for the same tokens (per token x block_tokens)",
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
    axes.set_xlabel("context (tokens)")
    axes.set_ylabel("ms")
    axes.set_ylim(bottom=0)
    axes.set_title("Decoding cost against context")
    axes.legend()


def _plot_block_sizes(axes, report: dict) -> None:
    rows = [row for row in report["block_sizes"] if row["block_size"] != AUTO]
    auto = [row for row in report["block_sizes"] if row["block_size"] == AUTO]
    axes.set_xscale("log", base=2)
    lines = _plot_sweep(axes, rows, "block_size", auto)
    if auto:  # "auto" has no place on the size axis: a level line per measure
        lines.append(axes.axhline(auto[0]["tpf"], color="tab:blue", linestyle=":", label="auto: tokens per forward"))
        lines.append(axes.accuracy_axes.axhline(auto[0]["accuracy"], color="tab:orange", linestyle=":", label="auto: accuracy"))
    axes.set_xlabel("block size")
    axes.legend(handles=lines, loc="best")
    axes.set_title(f"Block-size sweep ({report['meta']['sweep_task']}, threshold {report['meta']['threshold']})")


def _plot_thresholds(axes, report: dict) -> None:
    lines = _plot_sweep(axes, report["thresholds"], "threshold")
    axes.set_xlabel("confidence threshold")
    axes.legend(handles=lines, loc="best")
    axes.set_title(f"Threshold sweep ({report['meta']['sweep_task']}, block size {report['meta']['block_size']})")


def _plot_sweep(axes, rows: list[dict], key: str, extra_rows: list[dict] = ()) -> list:
    """TPF (left axis) and accuracy (right axis, kept on axes.accuracy_axes) against rows[i][key]."""
    xs = [row[key] for row in rows]
    tpf_line = axes.plot(xs, [row["tpf"] for row in rows], "o-", color="tab:blue", label="tokens per forward")
    axes.set_xticks(xs, [str(x) for x in xs])
    axes.set_ylabel("tokens per forward", color="tab:blue")
    axes.set_ylim(0, 1.2 * max(row["tpf"] for row in [*rows, *extra_rows]))  # headroom for the legend
    axes.accuracy_axes = axes.twinx()
    accuracy_line = axes.accuracy_axes.plot(xs, [row["accuracy"] for row in rows], "s--", color="tab:orange", label="accuracy")
    axes.accuracy_axes.set_ylabel("accuracy", color="tab:orange")
    axes.accuracy_axes.set_ylim(0, 1.05)
    return tpf_line + accuracy_line
