"""Markdown tables of a `clover bench` JSON report (for the README and models/README.md).

    python scripts/bench_table.py bench/results/2026-12-04-converted-cpu2.json
"""

import json
import sys

from cloverlm.bench.options import RUNNER_LABELS, RUNNERS


def cell(entry: dict | None, field: str) -> str:
    return "-" if not entry or entry.get(field) is None else f"{entry[field]:g}"


def main(path: str) -> None:
    report = json.load(open(path))
    runners = [r for r in RUNNERS if any(report["tasks"][t].get(r) for t in report["tasks"])]
    print("| task | " + " | ".join(f"{RUNNER_LABELS[r]}: accuracy / median s" for r in runners) + " | Clover TPF | speedup over generate |")
    print("|---" * (len(runners) + 3) + "|")
    for task, entry in report["tasks"].items():
        cells = [f"{cell(entry[r], 'accuracy')} / {cell(entry[r], 'wall_s_median')}" for r in runners]
        print(f"| {task} | " + " | ".join(cells) + f" | {entry['clover']['tpf']} | {entry['speedup']} |")
    medians = report["median_exec_s"]
    print("\nMedian wall time over all prompts: " + ", ".join(f"{RUNNER_LABELS[r]} {medians[r]} s" for r in runners if medians.get(r)))
    print("\n| context | Clover ms per block forward | peer ms for the same tokens | speedup |\n|---|---|---|---|")
    for row in report["context_scaling"]:
        peer = None if row["peer_token_ms"] is None else round(row["peer_token_ms"] * row["block_tokens"], 1)
        print(f"| {row['context']} | {row['clover_block_ms']} | {peer} | {row['speedup']} |")
    # reports before the threshold sweep have neither the section nor the sweeps' threshold and tokens/s
    sweeps = report["block_sizes"] + report.get("thresholds", [])
    print("\n| block size | threshold | TPF | tokens/s (batch) | accuracy |\n|---|---|---|---|---|")
    for row in sweeps:
        threshold = row.get("threshold", report["meta"]["threshold"])
        print(f"| {row['block_size']} | {threshold} | {row['tpf']} | {row.get('tokens_per_s')} | {row['accuracy']} |")


if __name__ == "__main__":
    main(sys.argv[1])
