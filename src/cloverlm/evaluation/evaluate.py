"""Per-task accuracy on held-out prompts, for Clover (decoded by the engine, all prompts of a task
batched) and for its autoregressive peer (transformers' generate, one prompt at a time).

An answer with a schema (the task's `answer_schema`, or the offered tools for a tool call) is decoded
under that grammar, for Clover and the peer alike (the peer with jump-forward), as `answers` says
(`decoding.grounding.ANSWER_MODES`: grounded by default, the plain schema, or free). The report says
which, and the share of answer tokens the grammar forced."""

from __future__ import annotations

import time
from collections.abc import Iterator

from tqdm import tqdm

from cloverlm import tasks
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grounding import DEFAULT_ANSWERS, schema_for
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.evaluation.heldout import answer_budget, heldout_examples
from cloverlm.tokenizer import stop_token_ids


def answer_grammar(grammars, task, example, answers: str = DEFAULT_ANSWERS) -> str | None:
    """The grammar an answer is decoded under in mode `answers`: a tool call's for the offered tools, else
    the task's schema (grounded in the example's prompt); None when free."""
    if answers == "free":
        return None
    if example.tools:
        tools = [(tool["function"]["name"], tool["function"].get("parameters")) for tool in example.tools]
        return grammars.tool_calls(tools, single=True)
    schema = schema_for(task.answer_schema(example), answers)
    return None if schema is None else grammars.json_schema(schema, example.prompt)


def forced_count(constraint, tokens: list[int]) -> int:
    """How many of `tokens` the grammar fixed (replayed through a fresh constraint)."""
    count = 0
    for token in tokens:
        run = constraint.forced()
        count += bool(run) and run[0] == token
        constraint.advance(token)
    return count


def _clover_completions(model, examples, stop_ids, fresh, *, block_size, threshold, batch_size, calibration) -> Iterator:
    engine = Engine(model, max_batch_size=batch_size, calibration=calibration)
    for index, encoded in enumerate(examples):
        params = DecodeParams(
            max_new_tokens=answer_budget(encoded), block_size=block_size, threshold=threshold, stop_token_ids=stop_ids
        )
        engine.submit(Request(encoded.ids[: encoded.prompt_length], params, request_id=index, constraint=fresh(index)))
    while engine.has_work():
        for completion in engine.step():
            yield completion.request_id, completion.tokens, completion.forwards


def _peer_completions(model, examples, stop_ids, fresh, prompt_lookup: int) -> Iterator:
    from cloverlm.convert.peer import peer_generate, peer_generate_constrained

    for index, encoded in enumerate(examples):
        prompt, budget = encoded.ids[: encoded.prompt_length], answer_budget(encoded)
        constraint = fresh(index)
        if constraint is not None:
            out = peer_generate_constrained(model, prompt, constraint, budget, stop_ids)
            yield index, out.tokens, out.forwards
        else:
            tokens = peer_generate(model, prompt, budget, stop_ids, prompt_lookup=prompt_lookup)
            yield index, tokens, len(tokens)  # counted as one forward per token, drafts or not


def evaluate_tasks(
    model,
    tokenizer,
    task_names,
    count: int,
    *,
    block_size: int | str = DecodeParams.block_size,
    threshold: float = DecodeParams.threshold,
    batch_size: int = 8,
    calibration=None,
    sizes: dict[str, dict[str, int]] | None = None,
    prompt_lookup: int = 0,
    answers: str = DEFAULT_ANSWERS,
    per_prompt: bool = False,
) -> dict:
    """Mean of each checker field over `count` held-out prompts per task, plus the tokens generated,
    tokens per forward and (under a grammar) the share of answer tokens it forced.
    `model` is Clover or the peer (the decoding options are Clover's); `sizes` gives a generator's size
    arguments by task (e.g. {"no_fly_zones": {"n_messages": 4}}); block_size="auto" needs `calibration`;
    prompt_lookup is the peer's free decoding's (see peer_generate); `answers` is the mode of the module doc.
    per_prompt=True adds each prompt's checker fields (report[task]["per_prompt"], in prompt order), for
    paired comparisons of two models on the same prompts."""
    from cloverlm.decoding.grammar import Grammars

    is_clover = model.config.model_type == "clover"
    stop_ids = stop_token_ids(tokenizer)
    schema_for(None, answers)  # a bad mode fails before minutes of decoding
    grammars = None if answers == "free" else Grammars(tokenizer, model.config.vocab_size, stop_ids)
    report = {}
    for name in task_names:
        task = tasks.get_task(name)
        examples = heldout_examples(tokenizer, name, count, 1 << 30, **(sizes or {}).get(name, {}))
        grammar = [answer_grammar(grammars, task, e.example, answers) for e in examples]

        def fresh(index: int, grammar=grammar):  # a new matcher each call: one to decode, one to count forced tokens
            return None if grammar[index] is None else grammars.constraint(grammar[index])

        if is_clover:
            completions = _clover_completions(
                model, examples, stop_ids, fresh, block_size=block_size, threshold=threshold,
                batch_size=batch_size, calibration=calibration,
            )  # fmt: skip
        else:
            completions = _peer_completions(model, examples, stop_ids, fresh, prompt_lookup)
        started = time.perf_counter()
        totals: dict[str, float] = {}
        scores: list[dict | None] = [None] * len(examples)
        tokens = forwards = forced = 0
        for index, generated, used in tqdm(completions, total=len(examples), desc=name, leave=False):
            scores[index] = task.check(examples[index].example, tokenizer.decode(generated))
            for key, value in scores[index].items():
                totals[key] = totals.get(key, 0.0) + value
            tokens += len(generated)
            forwards += used
            if grammar[index] is not None:
                forced += forced_count(fresh(index), generated)
        report[name] = {key: round(value / count, 4) for key, value in totals.items()}
        report[name]["new_tokens"] = tokens
        report[name]["tokens_per_forward"] = round(tokens / max(forwards, 1), 3)
        report[name]["constrained"] = any(g is not None for g in grammar)
        report[name]["answers"] = answers
        if report[name]["constrained"]:
            report[name]["forced_share"] = round(forced / max(tokens, 1), 3)
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        if per_prompt:
            report[name]["per_prompt"] = scores
    return report
