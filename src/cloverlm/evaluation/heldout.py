"""Held-out examples: a task example encoded as chat token ids, the deterministic held-out prompts of a
task and the answer budget they are decoded with.

Task examples for training use seeds below HELDOUT_SEED_BASE; evaluation uses seeds from it upwards, so
held-out prompts are never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from cloverlm import tasks
from cloverlm.errors import CloverError
from cloverlm.tokenizer import format_chat

HELDOUT_SEED_BASE = 1_000_000_000
ANSWER_SLACK = 16


@dataclass(frozen=True)
class TokenizedExample:
    ids: list[int]
    prompt_length: int  # tokens before the answer (never masked in chat mode)
    value_positions: list[int]  # answer tokens overlapping a copied value span (the copy probe)
    example: tasks.Example


def encode_example(tokenizer, example: tasks.Example) -> TokenizedExample:
    prompt_text, answer_text = format_chat(tokenizer, example.prompt, example.answer, tools=list(example.tools))
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer = tokenizer(answer_text, add_special_tokens=False, return_offsets_mapping=True)
    values = [
        len(prompt_ids) + i
        for i, (start, end) in enumerate(answer["offset_mapping"])
        if any(start < span_end and span_start < end for span_start, span_end in example.value_spans)
    ]
    ids = prompt_ids + answer["input_ids"] + [tokenizer.eos_token_id]
    return TokenizedExample(ids=ids, prompt_length=len(prompt_ids), value_positions=values, example=example)


def heldout_examples(tokenizer, task: str, count: int, max_len: int, **size) -> list[TokenizedExample]:
    """Deterministic held-out examples that fit the context."""
    out = []
    for seed in range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + 20 * count):
        encoded = encode_example(tokenizer, tasks.generate(task, seed, **size))
        if len(encoded.ids) <= max_len:
            out.append(encoded)
            if len(out) == count:
                return out
    raise CloverError(f"held-out {task} examples {size or ''} do not fit in {max_len} tokens; use a longer context")


def answer_budget(encoded: TokenizedExample) -> int:
    """Max new tokens for a held-out example: its reference answer's length + ANSWER_SLACK."""
    return len(encoded.ids) - encoded.prompt_length + ANSWER_SLACK
