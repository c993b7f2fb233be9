"""Repeat a list of values verbatim: the copying skill on its own.

Copying digit strings out of the prompt is what the extraction tasks need and what a small model
learns last (docs/design.md section 2). This task isolates it: the values look like those of the other tasks
(message ids, coordinates, radii, times, keys, numbers, words) and the answer repeats them in order, so every
answer value is a copy and the checker scores each item.
"""

import random

from cloverlm.tasks.base import Example, dumps, mean, same, spans_of
from cloverlm.tasks.kv_retrieval import WORDS
from cloverlm.tokenizer import parse_json


def _value(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        return f"{rng.choice('ABCDJMW')}{rng.randint(1000, 9999)}/26"
    if kind == 1:
        return f"{rng.randint(1, 69)}.{rng.randint(1, 9999):04d}"
    if kind == 2:
        return f"{rng.randint(0, 9)}.{rng.randint(1, 9)}"
    if kind == 3:
        return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.choice(('00', '30'))}Z"
    if kind == 4:
        return f"k-{rng.randrange(16**6):06x}"
    if kind == 5:
        return str(rng.randint(100000, 999999))
    return rng.choice(WORDS)  # words are the easy case: distinct tokens, copied by a one-token match


class Repeat:
    name = "repeat"

    def generate(self, seed: int, n_items: int = 8) -> Example:
        rng = random.Random(seed)
        items = [_value(rng) for _ in range(n_items)]
        answer = dumps(items)
        return Example(
            task=self.name,
            seed=seed,
            prompt="Values: " + " ".join(items) + "\nRepeat the values above exactly, in order, as a JSON list of strings.",
            answer=answer,
            truth=items,
            value_spans=spans_of(answer, items),
        )

    def answer_schema(self, example: Example) -> None:
        """None: a training task for copying; it is never decoded for a user."""
        return None

    def check(self, example: Example, output: str) -> dict[str, float]:
        pred = parse_json(output, "[")
        found = pred if isinstance(pred, list) else []
        return {
            "parsed": float(pred is not None),
            "item": mean(i < len(found) and same(found[i], t) for i, t in enumerate(example.truth)),
            "exact": float(same(pred, example.truth)),
        }
