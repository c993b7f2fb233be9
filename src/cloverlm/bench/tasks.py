"""The `tasks` and `median_exec_s` sections of `clover bench`: accuracy and latency per request, at
batch 1, for every runner in RUNNERS, each answer decoded as options.answers says (grounded schema,
plain schema or free; the fields are documented in bench/run.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from cloverlm import tasks as task_registry
from cloverlm.bench.llama_cpp import llama_cpp_generate
from cloverlm.bench.options import (
    RUNNERS,
    BenchModels,
    BenchOptions,
    accuracy,
    clover_params,
    prompt_ids,
    ratio,
)
from cloverlm.convert.peer import peer_generate, peer_generate_constrained
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.params import Request
from cloverlm.evaluation.evaluate import answer_grammar
from cloverlm.evaluation.heldout import TokenizedExample, answer_budget, heldout_examples
from cloverlm.tokenizer import stop_token_ids

PEER_FIELDS = ("accuracy", "wall_s_median", "tokens_per_s")


def spread_prompts(total: int, task_count: int) -> list[int]:
    """Prompts per task, as even as possible, the first tasks taking the remainder (49 over 4: 13, 12, 12, 12)."""
    base, extra = divmod(total, task_count)
    return [base + (index < extra) for index in range(task_count)]


@dataclass
class _Measured:
    """One prompt's results for one model: the first run's tokens (greedy: every run decodes the same)
    and the wall time of every run. A runner that does not take a prompt (peer_lookup under a grammar)
    has None in its place."""

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
    stops = stop_token_ids(tokenizer)
    grammars = None if options.answers == "free" else Grammars(tokenizer, models.clover.config.vocab_size, stops)
    # (task, example, the grammar its answer is decoded under or None)
    prompts = [
        (task, example, None if grammars is None else answer_grammar(grammars, task_registry.get_task(task), example.example, options.answers))
        for task, count in zip(options.tasks, counts)
        for example in heldout_examples(tokenizer, task, count, 1 << 30)
    ]
    engine = Engine(models.clover, max_batch_size=1)

    def constraint(grammar: str | None):  # a fresh matcher for each run
        return None if grammar is None else grammars.constraint(grammar)

    def clover(block_size: int) -> Callable:
        def run(example: TokenizedExample, grammar: str | None) -> tuple[list[int], int]:
            params = clover_params(example, options, tokenizer, block_size)
            completion = engine.generate([Request(prompt_ids(example), params, constraint=constraint(grammar))])[0]
            return completion.tokens, completion.forwards
        return run

    def peer(prompt_lookup: int) -> Callable:
        def run(example: TokenizedExample, grammar: str | None) -> tuple[list[int], int] | None:
            if grammar is not None:  # under a grammar: jump-forward, which drafts its own runs
                if prompt_lookup:
                    return None
                out = peer_generate_constrained(models.peer, prompt_ids(example), constraint(grammar), answer_budget(example), stops)
                return out.tokens, out.forwards
            tokens = peer_generate(models.peer, prompt_ids(example), answer_budget(example), stops, prompt_lookup)
            return tokens, len(tokens)  # forwards: only Clover's are reported
        return run

    def llama_cpp(example: TokenizedExample, grammar: str | None) -> tuple[list[int], int]:  # free only
        tokens = llama_cpp_generate(models.llama, prompt_ids(example), answer_budget(example), stops)
        return tokens, len(tokens)

    runners: dict[str, Callable] = {"clover": clover(options.block_size), "clover_b1": clover(1)}
    if models.peer is not None:
        runners["peer"] = peer(0)
        runners["peer_lookup"] = peer(options.peer_lookup)
    if models.llama is not None:
        runners["llama_cpp"] = llama_cpp
    _, shortest, shortest_grammar = min(prompts, key=lambda prompt: len(prompt[1].ids))
    for run in runners.values():
        run(shortest, shortest_grammar)  # warm-up: one-time allocations and lazy initialisation stay out of the timings
    measured: dict[str, list[_Measured | None]] = {name: [] for name in runners}
    with tqdm(total=options.repeats * len(prompts) * len(runners), desc="tasks") as bar:
        for repeat in range(options.repeats):
            for index, (_, example, grammar) in enumerate(prompts):
                for name, run in runners.items():
                    started = time.perf_counter()
                    result = run(example, grammar)
                    wall = time.perf_counter() - started
                    if repeat == 0:
                        measured[name].append(None if result is None else _Measured(*result, []))
                    if result is not None:
                        measured[name][index].walls.append(wall)
                    bar.update()

    def summary(name: str, task: str) -> dict | None:
        rows = [(example, m) for (t, example, _), m in zip(prompts, measured[name]) if t == task and m is not None]
        if not rows:
            return None
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
        entry["constrained"] = any(grammar is not None for t, _, grammar in prompts if t == task)
        entry["peer"] = entry["peer"] or dict.fromkeys(PEER_FIELDS)
        clover_wall = entry["clover"]["wall_s_median"]
        entry["speedup"] = ratio(entry["peer"]["wall_s_median"], clover_wall)
        # Clover's speedup over each other runner: its median wall time over Clover's
        entry["speedup_vs"] = {
            name: ratio(entry[name]["wall_s_median"], clover_wall) if entry[name] else None for name in RUNNERS[1:]
        }
        report[task] = entry
    median_exec_s = {
        name: round(statistics.median(m.wall for m in measured[name] if m), 5) if name in measured and any(measured[name]) else None
        for name in RUNNERS
    }
    all_clover = measured["clover"]
    tpf = sum(len(m.tokens) for m in all_clover) / sum(m.forwards for m in all_clover)
    return report, median_exec_s, tpf
