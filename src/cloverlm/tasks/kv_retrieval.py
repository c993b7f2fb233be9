"""Long-context key-value recall: find the values of 1-3 random keys among `n_pairs` lines."""

import random

from cloverlm.tasks.base import Example, dumps, mean, same, spans_of
from cloverlm.tokenizer import parse_json

WORDS = (
    "amber",
    "basil",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kelp",
    "lantern",
    "maple",
    "nectar",
    "onyx",
    "pepper",
    "quartz",
    "raven",
    "saffron",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "yarrow",
    "zephyr",
    "bramble",
    "cinder",
    "dune",
    "echo",
    "flint",
)


QUESTION = "Give the values of these keys as a JSON object: "
# A value is one of WORDS or six digits (`generate`); always a JSON string, never a number.
_VALUE = {"type": "string", "pattern": "^([a-z]+|[0-9]{6})$"}


class KVRetrieval:
    name = "kv_retrieval"

    def generate(self, seed: int, n_pairs: int = 60, n_queries: int | None = None) -> Example:
        rng = random.Random(seed)
        keys = [f"k-{n:06x}" for n in rng.sample(range(16**6), n_pairs)]
        values = [
            rng.choice(WORDS) if rng.random() < 0.5 else str(rng.randint(100000, 999999)) for _ in keys
        ]
        queried = rng.sample(range(n_pairs), n_queries or rng.randint(1, min(3, n_pairs)))
        truth = {keys[i]: values[i] for i in queried}
        lines = [f"{k}: {v}" for k, v in zip(keys, values)]
        question = f"{QUESTION}{', '.join(truth)}."
        answer = dumps(truth)
        return Example(
            task=self.name,
            seed=seed,
            prompt="\n".join([*lines, question]),
            answer=answer,
            truth=truth,
            value_spans=spans_of(answer, [text for pair in truth.items() for text in pair]),
        )

    def answer_schema(self, example: Example) -> dict:
        """An object with exactly the keys the question names, in its order (read from the prompt, so the
        schema tells nothing the question does not), each a string value."""
        keys = example.prompt.rpartition("\n")[2].removeprefix(QUESTION).removesuffix(".").split(", ")
        return {
            "type": "object",
            "properties": {key: dict(_VALUE) for key in keys},
            "required": keys,
            "additionalProperties": False,
        }

    def check(self, example: Example, output: str) -> dict[str, float]:
        pred = parse_json(output, "{")
        found = pred if isinstance(pred, dict) else {}
        return {
            "parsed": float(pred is not None),
            "value": mean(same(found.get(k), v) for k, v in example.truth.items()),
            "exact": float(same(pred, example.truth)),
        }
