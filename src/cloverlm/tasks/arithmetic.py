"""Small multi-step computations: chains of variable assignments, or one operation on a list of ints.

Answers are computed rather than copied, so these examples carry no value spans.
"""

import operator
import random

from cloverlm.tasks.base import Example, dumps, same
from cloverlm.tokenizer import parse_json

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# Each operation takes the list and a count k (ignored by most) and gives a number or a list.
_LIST_OPS = (
    ("Sort the list in ascending order.", lambda xs, k: sorted(xs)),
    ("Sort the list in descending order.", lambda xs, k: sorted(xs, reverse=True)),
    ("Reverse the list.", lambda xs, k: xs[::-1]),
    ("Give the first {k} items.", lambda xs, k: xs[:k]),
    ("Give the last {k} items.", lambda xs, k: xs[-k:]),
    ("What is the sum of the list?", lambda xs, k: sum(xs)),
    ("What is the largest item?", lambda xs, k: max(xs)),
    ("Remove duplicates, keeping the first occurrence of each item.", lambda xs, k: list(dict.fromkeys(xs))),
)


def _chain(rng: random.Random) -> tuple[str, int]:
    names = rng.sample("abcdefghmnpqrstuvwxyz", rng.randint(2, 4))
    env = {names[0]: rng.randint(1, 9)}
    lines = [f"{names[0]} = {env[names[0]]}"]
    for prev, name in zip(names, names[1:]):
        op = rng.choice(tuple(_OPS))
        # Multiplying only by literals keeps results small; +/- may also reuse any earlier variable.
        if op == "*" or rng.random() < 0.5:
            operand = rng.randint(2, 9)
            other = str(operand)
        else:
            other = rng.choice(list(env))
            operand = env[other]
        env[name] = _OPS[op](env[prev], operand)
        lines.append(f"{name} = {prev} {op} {other}")
    return "\n".join([*lines, f"What is {names[-1]}?"]), env[names[-1]]


def _list_op(rng: random.Random) -> tuple[str, int | list[int]]:
    xs = [rng.randint(0, 9) for _ in range(rng.randint(5, 10))]
    question, op = rng.choice(_LIST_OPS)
    k = rng.randint(1, len(xs) - 1)
    return f"List: {xs}\n{question.format(k=k)}", op(xs, k)


class Arithmetic:
    name = "arithmetic"

    def generate(self, seed: int) -> Example:
        rng = random.Random(seed)
        prompt, result = rng.choice((_chain, _list_op))(rng)
        return Example(
            task=self.name, seed=seed, prompt=prompt, answer=dumps(result), truth=result, value_spans=()
        )

    def answer_schema(self, example: Example) -> None:
        """None: a computed number or list, nothing in it to force."""
        return None

    def check(self, example: Example, output: str) -> dict[str, float]:
        pred = parse_json(output)
        return {"parsed": float(pred is not None), "exact": float(same(pred, example.truth))}
