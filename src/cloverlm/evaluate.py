"""Per-task accuracy on held-out prompts, decoded by the engine (all prompts of a task batched)."""

from __future__ import annotations

import time

from tqdm import tqdm

from . import tasks
from .data import heldout_examples
from .engine import DecodeParams, Engine, Request


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """End of text and end of the assistant turn."""
    return (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))


def evaluate_tasks(
    model,
    tokenizer,
    task_names,
    count: int,
    *,
    block_size: int | str = 16,
    threshold: float = 1.0,
    batch_size: int = 8,
    calibration=None,
) -> dict:
    """Mean of each checker field over `count` held-out prompts per task, plus tokens per forward.
    block_size="auto" needs the model's `calibration`."""
    report = {}
    for name in task_names:
        task = tasks.get_task(name)
        examples = heldout_examples(tokenizer, name, count, 1 << 30)
        requests = []
        for index, encoded in enumerate(examples):
            answer_tokens = len(encoded.ids) - encoded.prompt_length
            params = DecodeParams(
                max_new_tokens=answer_tokens + 16,
                block_size=block_size,
                threshold=threshold,
                stop_token_ids=stop_token_ids(tokenizer),
            )
            requests.append(Request(encoded.ids[: encoded.prompt_length], params, request_id=index))
        engine = Engine(model, max_batch_size=batch_size, calibration=calibration)
        for request in requests:
            engine.submit(request)
        started = time.perf_counter()
        totals: dict[str, float] = {}
        tokens = forwards = 0
        with tqdm(total=len(requests), desc=name, leave=False) as bar:
            while engine.has_work():
                for completion in engine.step():
                    scores = task.check(examples[completion.request_id].example, tokenizer.decode(completion.tokens))
                    for key, value in scores.items():
                        totals[key] = totals.get(key, 0.0) + value
                    tokens += len(completion.tokens)
                    forwards += completion.forwards
                    bar.update()
        report[name] = {key: round(value / count, 4) for key, value in totals.items()}
        report[name]["tokens_per_forward"] = round(tokens / max(forwards, 1), 3)
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
    return report
