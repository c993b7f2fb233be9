"""Graft stage 1's step time in this checkout (or in the code PYTHONPATH points at): the student of
runs/graft-stage1's checkpoint against models/smollm2-clover, a warm-up step, then STEPS timed steps of the
same batches (2 rows of 512 tokens), in a fresh process. Prints one JSON line: median seconds a step,
tokens/s, the loss of the first timed step (equal batches give comparable losses) (models/README.md).

Interleave the code states, one process at a time, nothing else running, e.g.:

    git worktree add /tmp/ab-old e755a60
    for round in 1 2 3; do for src in /tmp/ab-old/src src; do
        PYTHONPATH=$src .venv/bin/python scripts/graft_stage1_ab.py 6 $src; done; done
"""

import json
import statistics
import sys
import tempfile
import time

import torch

import cloverlm
from cloverlm.training.graft.stage1 import GraftStage1, Stage1Config


def main() -> None:
    steps, label = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as out:
        cfg = Stage1Config(teacher="models/smollm2-clover", student="runs/graft-stage1/checkpoint", out=out,
                           max_steps=4900)  # fmt: skip
        loop = GraftStage1(cfg)
        loop.train_step(0)
        seconds, losses = [], []
        for step in range(1, steps + 1):
            start = time.perf_counter()
            losses.append(loop.train_step(step)["loss"])
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    tokens = cfg.rows_per_step * cfg.seq_len
    print(json.dumps({"code": label, "package": cloverlm.__file__, "student_autocast": loop.bf16,
                      "median_step_s": round(median, 3), "tok_s": round(tokens / median, 1),
                      "steps_s": [round(s, 2) for s in seconds], "first_loss": round(losses[0], 5)}))  # fmt: skip


if __name__ == "__main__":
    main()
