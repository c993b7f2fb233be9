"""The conversion trainer from the shipped adapter, STEPS steps of 1 row x 1,600 tokens, in one process
(MODE whole) or in chunks of ten, each a fresh process (MODE chunks: training/conversion/chunks.py); prints
tokens over wall time, starts included, and tok/s per ten steps (models/README.md).

    for m in whole chunks; do .venv/bin/python scripts/train_chunks_ab.py 30 $m /tmp/chunks-ab/$m; done
"""

import json
import sys
import time
from pathlib import Path

import torch

from cloverlm.training.conversion.chunks import train_in_chunks
from cloverlm.training.conversion.trainer import ConvertConfig


def main() -> None:
    steps, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(2)
    cfg = ConvertConfig(out=out, tokens_per_step=1600, rows_per_step=1, noisy_draws=2, max_steps=steps, checkpoint_every=10,
                        eval_every=1000, init_adapter="models/smollm2-clover", lr=5e-5, warmup_steps=10)  # fmt: skip
    start = time.time()
    summary = train_in_chunks(cfg, chunk_steps=10 if mode == "chunks" else steps)
    wall = time.time() - start
    records = [json.loads(line) for line in open(Path(out) / "train_log.jsonl") if '"tokens"' in line]
    timed, last = [], 0.0
    for record in records:  # each chunk's log starts its own clock
        elapsed = record["elapsed_s"]
        timed.append((record["tokens"], elapsed - last if elapsed > last else elapsed))
        last = elapsed
    per_ten = [round(sum(t for t, _ in timed[i : i + 10]) / sum(s for _, s in timed[i : i + 10]), 1)
               for i in range(0, len(timed), 10)]  # fmt: skip
    tokens = sum(t for t, _ in timed)
    print(json.dumps({"mode": mode, "steps": summary["step"], "tokens": tokens, "wall_s": round(wall, 1),
                      "tok_per_wall_s": round(tokens / wall, 1), "tok_s_per_ten_steps": per_ten}))  # fmt: skip


if __name__ == "__main__":
    main()
