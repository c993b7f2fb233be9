"""The bench's decisions section: drone_slots puzzles answered one at a time, jointly, and jointly with
distinct answers (cloverlm.decoding.decisions): the rate of mutually consistent answer sets, and wall time."""

from __future__ import annotations

import statistics

from cloverlm.decoding.decisions import decide
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams
from cloverlm.tasks.drone_slots import DroneSlots, consistent
from cloverlm.tokenizer import stop_token_ids


def bench_decisions(model, tokenizer, prompts: int, drones: int = 8, threshold: float = DecodeParams.threshold) -> dict:
    """drone_slots puzzles answered one at a time, jointly, and jointly with distinct answers enforced:
    no_overlap (no shared zone), consistent (no shared zone and every zone allowed) and exact rates,
    per-drone accuracy, median wall time and forwards per puzzle."""
    task = DroneSlots()
    examples = [task.generate(10_000_000 + seed, drones=drones) for seed in range(prompts)]
    params = DecodeParams(threshold=threshold, stop_token_ids=stop_token_ids(tokenizer))
    engine = Engine(model, max_batch_size=1)
    report = {}
    for mode, joint, distinct in (("one_at_a_time", False, False), ("joint", True, False), ("joint_distinct", True, True)):
        rows = []
        for example in examples:
            decision = decide(model, tokenizer, task.questions(example), example.prompt, joint, params, engine, distinct)
            zones = {str(i + 1): answer for i, answer in enumerate(decision.answers)}
            truth = example.truth["zones"]
            rows.append({
                "no_overlap": len(set(decision.answers)) == len(decision.answers),
                "consistent": consistent(zones, example.truth["allowed"]),
                "exact": zones == truth,
                "drone_accuracy": statistics.mean(zones[k] == v for k, v in truth.items()),
            })
            rows[-1]["seconds"], rows[-1]["forwards"] = decision.seconds, decision.forwards
        report[mode] = {name: round(float(statistics.mean(r[name] for r in rows)), 4)
                        for name in ("no_overlap", "consistent", "exact", "drone_accuracy")}
        report[mode]["wall_s_median"] = round(statistics.median(r["seconds"] for r in rows), 5)
        report[mode]["forwards_median"] = statistics.median(r["forwards"] for r in rows)
    report["prompts"], report["drones"], report["threshold"] = prompts, drones, threshold
    return report
