"""block_size=auto under two calibrations of the same model (the shipped folder's and another folder's, e.g.
a copy holding the calibration before a refit) against B=16 / 32 / 64: held-out no_fly prompts under the
grounded schema, one request at a time, every setting in turn per prompt (models/README.md). Run it alone.

    .venv/bin/python scripts/auto_costs_ab.py 20 /tmp/clover-oldcal
"""

import json
import statistics
import sys
import time
from collections import Counter

import torch

from cloverlm.bench.options import BenchOptions, accuracy, clover_params, prompt_ids
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.decoding.calibration import load_calibration
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.params import Request
from cloverlm.evaluation.evaluate import answer_grammar
from cloverlm.evaluation.heldout import heldout_examples
from cloverlm.model.checkpoint import inference_dtype
from cloverlm.tasks import get_task
from cloverlm.tokenizer import stop_token_ids

FOLDER, TASK = "models/smollm2-clover", "no_fly_zones"


def main() -> None:
    torch.set_num_threads(2)
    model, tokenizer = load_model(FOLDER, inference_dtype("cpu")), load_folder_tokenizer(FOLDER)
    saved = load_calibration(FOLDER)
    other = load_calibration(sys.argv[2])
    options = BenchOptions()
    grammars = Grammars(tokenizer, model.config.vocab_size, stop_token_ids(tokenizer))
    settings = {"B16": (16, saved), "B32": (32, saved), "B64": (64, saved), "auto_other": ("auto", other), "auto_shipped": ("auto", saved)}
    totals = {name: {"tokens": 0, "forwards": 0, "seconds": [], "scores": [], "sizes": Counter()} for name in settings}
    for example in heldout_examples(tokenizer, TASK, int(sys.argv[1]), 1 << 30):
        grammar = answer_grammar(grammars, get_task(TASK), example.example, options.answers)
        for name, (size, calibration) in settings.items():
            engine = Engine(model, max_batch_size=1, calibration=calibration, record_blocks=True)
            request = Request(prompt_ids(example), clover_params(example, options, tokenizer, size),
                              constraint=grammars.constraint(grammar))  # fmt: skip
            start = time.perf_counter()
            [completion] = engine.generate([request])
            total = totals[name]
            total["seconds"].append(time.perf_counter() - start)
            total["tokens"] += len(completion.tokens)
            total["forwards"] += completion.forwards
            total["scores"].append(accuracy(TASK, example, completion.tokens, tokenizer))
            total["sizes"].update(record.size for record in completion.block_records)
    for name, total in totals.items():
        against = [b / s for b, s in zip(totals["B32"]["seconds"], total["seconds"])]
        print(json.dumps({"setting": name, "tokens_per_s": round(total["tokens"] / sum(total["seconds"]), 2),
                          "tpf": round(total["tokens"] / total["forwards"], 3), "median_s": round(statistics.median(total["seconds"]), 3),
                          "accuracy": round(statistics.mean(total["scores"]), 4),
                          "speed_vs_B32_median_ratio": round(statistics.median(against), 4), "sizes": dict(total["sizes"])}))  # fmt: skip


if __name__ == "__main__":
    main()
