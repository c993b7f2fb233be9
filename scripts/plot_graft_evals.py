"""The memory graft's progress as its reports saw it (issue 30): each student's recall as a share of its
teacher's and its KL against the teacher, over the tokens its graft stages had trained when `clover graft-eval`
measured it (the report's `trained` record), one line per student folder, the issue's 0.9 marked.

Run: python scripts/plot_graft_evals.py models/graft/graft_eval_hybrid_stage1_*.json --out models/graft/hybrid_progress.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RECALL_TARGET = 0.9  # issue 30: kv_retrieval recall >= 0.9 of the teacher's after stage 1
STAGE1_MILLIONS = 5.0  # issue 30: stage 1 at >= 5M tokens (scripts/graft.sh's STAGE1_STEPS)
SHARES = (("recall_of_teacher", "recall", "-"), ("kv_of_teacher", "kv", "--"), ("needle_of_teacher", "needle", ":"))


def points(reports: list[Path]) -> dict[str, list[dict]]:
    """Per student folder, its measurements in order of trained tokens: tokens (every stage's), KL and the shares."""
    by_student: dict[str, list[dict]] = defaultdict(list)
    for path in reports:
        report = json.loads(path.read_text())
        for row in report["students"]:
            trained = row.get("trained")
            if not trained:
                raise SystemExit(f"{path}: {row['student']} has no training record (a graft folder's `trained`)")
            tokens = sum(state["tokens"] for state in trained.values())
            by_student[row["student"]].append({"tokens": tokens, "kl": row["kl"], **{key: row[key] for key, _, _ in SHARES}})
    return {student: sorted(rows, key=lambda r: r["tokens"]) for student, rows in by_student.items()}


def plot(by_student: dict[str, list[dict]], out: Path) -> None:
    figure, (shares, kl) = plt.subplots(1, 2, figsize=(11, 4.5))
    for student, rows in by_student.items():
        millions = [r["tokens"] / 1e6 for r in rows]
        name = Path(student).name
        for key, label, style in SHARES:
            shares.plot(millions, [r[key] for r in rows], style, marker="o", label=f"{name}: {label}")
        kl.plot(millions, [r["kl"] for r in rows], marker="o", label=name)
        for x, row in zip(millions, rows):
            shares.annotate(f"{row['recall_of_teacher']:.2f}", (x, row["recall_of_teacher"]), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
    shares.axhline(RECALL_TARGET, color="grey", linewidth=0.8)
    shares.text(0, RECALL_TARGET, " issue 30's target (recall)", va="bottom", fontsize=8, color="grey")
    shares.text(STAGE1_MILLIONS, 0.02, "stage 1's 5M ", ha="right", fontsize=8, color="grey")
    shares.set(xlabel="graft training tokens (millions)", ylabel="share of the teacher's", ylim=(0, 1.05),
               title="Recall as a share of the teacher's")  # fmt: skip
    kl.set(xlabel="graft training tokens (millions)", ylabel="nats a token", title="Held-out KL against the teacher")
    kl.set_ylim(bottom=0)
    for axis in (shares, kl):
        axis.axvline(STAGE1_MILLIONS, color="grey", linewidth=0.8, linestyle=":")
        axis.set_xlim(0, max(axis.get_xlim()[1], STAGE1_MILLIONS * 1.05))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="graft_eval.json files of `clover graft-eval`")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    plot(points(args.reports), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
