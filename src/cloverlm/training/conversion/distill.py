"""Trajectory self-distillation data (`clover train --recipe distill`): the model's own one-token-a-step
answers to training prompts, kept only where the task's checker says they are exactly right.

Training on them (the mixture's "distill" source, with certainty forcing in objective.conversion_loss)
teaches the model to commit more of the answers it already gives per step, as dParallel and d3LLM do,
without pulling it towards any other answer. The prompts are a pure function of (seed, index), and the
file is appended to as answers arrive, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tqdm import tqdm

from cloverlm import tasks
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.errors import CloverError
from cloverlm.evaluation.heldout import answer_budget, encode_example
from cloverlm.tokenizer import stop_token_ids
from cloverlm.training.conversion.data import TASK_SOURCES, sample_task_example


def trajectory_example(index: int, mixture: dict[str, float], seed: int, full_size_share: float) -> tasks.Example:
    """Prompt `index` of a trajectories file: a training example of a task drawn from `mixture`."""
    rng = random.Random(f"distill/{seed}/{index}")
    names = [name for name in mixture if name in TASK_SOURCES and mixture[name] > 0]
    if not names:
        raise CloverError(f"the mixture {mixture} names no task to distil; choose from: {', '.join(TASK_SOURCES)}")
    name = rng.choices(names, [mixture[n] for n in names])[0]
    return sample_task_example(name, rng, full_size_share)


def read_done(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def make_trajectories(
    model, tokenizer, path: Path, count: int, mixture: dict[str, float], *, seed: int = 0, full_size_share: float = 0.3,
    batch_size: int = 16,
) -> dict:
    """Append to `path` until it holds `count` prompts' one-token-a-step answers (batched through the
    engine), each with its checker's scores and whether it is kept (exact). Returns the file's summary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {record["index"] for record in read_done(path)}
    todo = [i for i in range(count) if i not in done]
    stops = stop_token_ids(tokenizer)
    engine = Engine(model, max_batch_size=batch_size)
    pending = {}
    for index in todo:
        example = trajectory_example(index, mixture, seed, full_size_share)
        encoded = encode_example(tokenizer, example)
        pending[index] = (example, encoded)
        params = DecodeParams(max_new_tokens=answer_budget(encoded), block_size=1, stop_token_ids=stops)
        engine.submit(Request(encoded.ids[: encoded.prompt_length], params, request_id=index))
    with path.open("a") as out, tqdm(total=count, initial=count - len(todo), desc="trajectories", dynamic_ncols=True) as bar:
        while engine.has_work():
            for completion in engine.step():
                example, encoded = pending.pop(completion.request_id)
                scores = tasks.get_task(example.task).check(example, tokenizer.decode(completion.tokens))
                record = {"index": completion.request_id, "task": example.task, "seed": example.seed,
                          "prompt_ids": encoded.ids[: encoded.prompt_length], "answer_ids": completion.tokens,
                          "kept": scores.get("exact") == 1.0, "scores": scores}  # fmt: skip
                out.write(json.dumps(record) + "\n")
                out.flush()
                bar.update(1)
    return summarize(read_done(path))


def summarize(records: list[dict]) -> dict:
    by_task: dict[str, dict[str, int]] = {}
    for record in records:
        counts = by_task.setdefault(record["task"], {"tried": 0, "kept": 0})
        counts["tried"] += 1
        counts["kept"] += int(record["kept"])
    return {"tried": len(records), "kept": sum(c["kept"] for c in by_task.values()), "by_task": by_task}


# The distillation recipe: the trajectories and a quarter of self-distilled chat (to keep chat behaviour),
# a gentler learning rate than the conversion's, since it starts from a trained adapter.
DISTILL_MIXTURE = {"distill": 0.75, "chat": 0.25}
DISTILL_LR = 2e-4
DISTILL_WARMUP = 10
CERTAINTY_WEIGHT = 0.5  # not tuned: the one value tried so far (models/README.md)
TRAJECTORIES = "trajectories.jsonl"


def distill_config(out: str, **fields):
    """The ConvertConfig of `--recipe distill` into `out` (fields: init_adapter and any overrides)."""
    from cloverlm.training.conversion.config import ConvertConfig

    defaults = {"mixture": dict(DISTILL_MIXTURE), "lr": DISTILL_LR, "warmup_steps": DISTILL_WARMUP,
                "certainty_weight": CERTAINTY_WEIGHT}  # fmt: skip
    return ConvertConfig(out=out, distill_data=str(Path(out) / TRAJECTORIES), **(defaults | fields))
