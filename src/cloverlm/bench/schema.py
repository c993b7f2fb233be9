"""The `schema` section of `clover bench`: structured extraction as a user would run it, the no-fly zones
of `schema_messages` air-traffic messages returned as JSON, on `schema_prompts` held-out prompts.

Each prompt is decoded one request at a time (batch 1: latency) by five runners, in turn prompt by
prompt, so drift in the machine's speed hits them alike:
* clover_free: Clover at the bench's block size and threshold, no grammar;
* clover_schema: the same under the answer's plain JSON schema (the task's `answer_schema` without its
  grounding), whose grammar writes every key, quote and bracket into the block without a forward;
* clover_grounded: the same under the grounded schema (every copied value one written in the prompt:
  decoding/grounding.py);
* peer_schema, peer_grounded: the autoregressive peer under the same grammars, with jump-forward
  decoding (forced runs read in one forward: convert/peer.py's peer_generate_constrained).

Per runner: parsed and schema_valid (shares of answers that parse as JSON / validate against the
schema), truncated (share cut at the answer budget, the reference's length + ANSWER_SLACK tokens, as
`clover eval` cuts them, without validating: under the schema the only way not to, where the schema
could not close in the budget), zone_exact (mean
zone_exact_match), tokens and forwards summed over the prompts, tpf (tokens per forward), forced_share
(share of the answer tokens the grammar fixed; null when free), wall_s_median (median wall seconds per
request), ms_per_forward (summed wall over summed forwards, the prompt's prefill included: fewer
forwards share it, so this rises as TPF does), grammar_ms_per_forward (time inside the grammar's calls,
masks, checks, advances and forced runs, over forwards; null when free), refused (model choices the
grammar allowed that json_guard's rules or budget-aware closing turned down, summed; null when free:
on answers that do not loop, what those rules cost).
Then, from the same run:
* schema_cost_per_forward = 1 + clover_schema grammar_ms_per_forward / clover_free ms_per_forward: a
  constrained forward's cost over a free one's, the grammar's host work being the difference;
* tpf_gain = clover_schema tpf / clover_free tpf;
* speedup = peer_schema wall_s_median / clover_schema wall_s_median (null without a peer), and
  speedup_grounded the same for the grounded runners;
* grounded_gain: per model, grounded over plain schema for zone_exact and tpf.
"""

from __future__ import annotations

import json
import statistics
import time

import jsonschema
from tqdm import tqdm

from cloverlm import tasks
from cloverlm.bench.options import BenchModels, BenchOptions, clover_params, prompt_ids, ratio
from cloverlm.convert.peer import peer_generate_constrained
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.grounding import without_grounding
from cloverlm.decoding.params import Request
from cloverlm.evaluation.evaluate import forced_count
from cloverlm.evaluation.heldout import answer_budget, heldout_examples
from cloverlm.tokenizer import parse_json, stop_token_ids

SCHEMA_TASK = "no_fly_zones"
SCHEMA_RUNNERS = ("clover_free", "clover_schema", "clover_grounded", "peer_schema", "peer_grounded")


def _schema_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def bench_schema(models: BenchModels, options: BenchOptions) -> dict:
    """The `schema` report; fields in the module docstring."""
    tokenizer = models.tokenizer
    task = tasks.get_task(SCHEMA_TASK)
    stops = stop_token_ids(tokenizer)
    grammars = Grammars(tokenizer, models.clover.config.vocab_size, stops)
    examples = heldout_examples(tokenizer, SCHEMA_TASK, options.schema_prompts, 1 << 30, n_messages=options.schema_messages)
    schemas = [task.answer_schema(encoded.example) for encoded in examples]
    plain = [without_grounding(schema) for schema in schemas]
    grammar = {"schema": [grammars.json_schema(schema) for schema in plain],
               "grounded": [grammars.json_schema(schema, e.example.prompt) for schema, e in zip(schemas, examples)]}
    engine = Engine(models.clover, max_batch_size=1)

    def clover(index: int, mode: str | None) -> tuple[list[int], int, float | None]:
        encoded = examples[index]
        constraint = _TimedConstraint(grammars.constraint(grammar[mode][index])) if mode else None
        params = clover_params(encoded, options, tokenizer, options.block_size)
        [completion] = engine.generate([Request(prompt_ids(encoded), params, constraint=constraint)])
        return completion.tokens, completion.forwards, constraint

    def peer(index: int, mode: str) -> tuple[list[int], int, float]:
        encoded = examples[index]
        constraint = _TimedConstraint(grammars.constraint(grammar[mode][index]))
        out = peer_generate_constrained(models.peer, prompt_ids(encoded), constraint, answer_budget(encoded), stops)
        return out.tokens, out.forwards, constraint

    runners = {"clover_free": (clover, None), "clover_schema": (clover, "schema"), "clover_grounded": (clover, "grounded")}
    if models.peer is not None:
        runners |= {"peer_schema": (peer, "schema"), "peer_grounded": (peer, "grounded")}
    for run, mode in runners.values():
        run(0, mode)  # warm-up: one-time allocations and the grammar compiler stay out of the timings
    rows: dict[str, list[dict]] = {name: [] for name in runners}
    with tqdm(total=len(examples) * len(runners), desc="schema") as bar:
        for index, encoded in enumerate(examples):
            for name, (run, mode) in runners.items():
                started = time.perf_counter()
                tokens, forwards, constraint = run(index, mode)
                wall = time.perf_counter() - started
                text = tokenizer.decode(tokens)
                rows[name].append({
                    "tokens": len(tokens), "forwards": forwards, "wall": wall, "grammar": constraint and constraint.seconds,
                    "refused": constraint and constraint.constraint.refused,
                    "parsed": parse_json(text, "[") is not None,
                    "valid": _schema_valid(text, plain[index]),
                    "truncated": len(tokens) >= answer_budget(encoded) and not _schema_valid(text, plain[index]),
                    "zone_exact": task.check(encoded.example, text)["zone_exact_match"],
                    "forced": forced_count(grammars.constraint(grammar[mode][index]), tokens) if mode else None,
                })  # fmt: skip
                bar.update()

    report: dict = {name: _summary(rows[name]) if name in rows else None for name in SCHEMA_RUNNERS}
    free, constrained = report["clover_free"], report["clover_schema"]
    grammar_ms = constrained["grammar_ms_per_forward"]
    report["schema_cost_per_forward"] = round(1 + grammar_ms / free["ms_per_forward"], 3)
    report["tpf_gain"] = ratio(constrained["tpf"], free["tpf"])
    for suffix, mode in (("", "schema"), ("_grounded", "grounded")):
        peer_report, clover_report = report[f"peer_{mode}"], report[f"clover_{mode}"]
        report[f"speedup{suffix}"] = ratio(peer_report and peer_report["wall_s_median"], clover_report["wall_s_median"])
    report["grounded_gain"] = {
        model: {key: ratio(report[f"{model}_grounded"][key], report[f"{model}_schema"][key]) for key in ("zone_exact", "tpf")}
        if report[f"{model}_schema"] else None for model in ("clover", "peer")
    }
    report["prompts"], report["messages"] = len(examples), options.schema_messages
    return report


def _summary(rows: list[dict]) -> dict:
    tokens, forwards, wall = (sum(row[key] for row in rows) for key in ("tokens", "forwards", "wall"))
    forced = [row["forced"] for row in rows if row["forced"] is not None]
    return {
        "parsed": round(statistics.mean(row["parsed"] for row in rows), 4),
        "schema_valid": round(statistics.mean(row["valid"] for row in rows), 4),
        "truncated": round(statistics.mean(row["truncated"] for row in rows), 4),
        "zone_exact": round(statistics.mean(row["zone_exact"] for row in rows), 4),
        "tokens": tokens,
        "forwards": forwards,
        "tpf": round(tokens / max(forwards, 1), 3),
        "forced_share": round(sum(forced) / max(tokens, 1), 3) if forced else None,
        "wall_s_median": round(statistics.median(row["wall"] for row in rows), 4),
        "ms_per_forward": round(1000 * wall / max(forwards, 1), 2),
        "grammar_ms_per_forward": round(1000 * sum(row["grammar"] for row in rows) / max(forwards, 1), 3) if forced else None,
        # model choices the grammar allowed but json_guard's rules (guard) or the budget's ending (budget) refused
        "refused": {key: sum(row["refused"][key] for row in rows) for key in ("guard", "budget")} if forced else None,
    }


class _TimedConstraint:
    """A constraint that adds up the seconds spent inside it (the grammar's host work)."""

    def __init__(self, constraint):
        self.constraint, self.seconds = constraint, 0.0

    def _timed(self, method, *args):
        started = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.seconds += time.perf_counter() - started

    def allowed(self, within_budget: bool = True, scores=None):
        return self._timed(self.constraint.allowed, within_budget, scores)

    def allows(self, token: int) -> bool:
        return self._timed(self.constraint.allows, token)

    def advance(self, token: int) -> None:
        self._timed(self.constraint.advance, token)

    def forced(self) -> list[int]:
        return self._timed(self.constraint.forced)

    def limit(self, tokens: int) -> None:
        self.constraint.limit(tokens)

    def finished(self) -> bool:
        return self._timed(self.constraint.finished)
