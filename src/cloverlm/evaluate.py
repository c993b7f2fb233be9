"""Per-task accuracy on held-out prompts with the simple decoder."""

from __future__ import annotations

import time

from tqdm import tqdm

from . import tasks
from .data import heldout_examples
from .generate import generate


def evaluate_tasks(model, tokenizer, task_names, count: int, *, block_size: int = 16, threshold: float = 1.0) -> dict:
    """Mean of each checker field over `count` held-out prompts per task, plus tokens per forward."""
    stops = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    report = {}
    for name in task_names:
        task = tasks.get_task(name)
        totals: dict[str, float] = {}
        tokens = forwards = 0
        started = time.perf_counter()
        for encoded in tqdm(heldout_examples(tokenizer, name, count, 1 << 30), desc=name, leave=False):
            answer_ids = len(tokenizer(encoded.example.answer, add_special_tokens=False)["input_ids"])
            result = generate(
                model,
                encoded.ids[: encoded.prompt_length],
                max_new_tokens=answer_ids + 16,
                block_size=block_size,
                threshold=threshold,
                stop_ids=stops,
            )
            scores = task.check(encoded.example, tokenizer.decode(result.tokens))
            for key, value in scores.items():
                totals[key] = totals.get(key, 0.0) + value
            tokens += len(result.tokens)
            forwards += result.forwards
        report[name] = {key: round(value / count, 4) for key, value in totals.items()}
        report[name]["tokens_per_forward"] = round(tokens / max(forwards, 1), 3)
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
    return report
