"""No-fly-zone accuracy by the number of air-traffic messages per prompt, for Clover and its peer.

The from-scratch models (scripts/train_default.sh) are trained on prompts of 1-4 messages and the demo
shows 20: this measures how far copying carries. Greedy decoding, Clover one token per step (block size 1) so that both models
decode the same way; held-out prompts. Writes JSON and a plot:

  python scripts/eval_by_messages.py --messages 1 2 4 8 20 --n 20 --out runs/export/eval_by_messages.json
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from cloverlm.convert.load import load_folder_tokenizer, load_model  # noqa: E402
from cloverlm.convert.peer import load_peer  # noqa: E402
from cloverlm.evaluation.evaluate import evaluate_tasks  # noqa: E402

FIELDS = ("zone_exact_match", "field/id", "field/lat", "field/radius", "count")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/export/clover-tiny")
    parser.add_argument("--peer", default="runs/export/qwen3.5-moe-tiny")
    parser.add_argument("--messages", type=int, nargs="+", default=[1, 2, 4, 8, 20])
    parser.add_argument("--n", type=int, default=20, help="held-out prompts per message count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/export/eval_by_messages.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"clover": load_model(args.model), "peer": load_peer(args.peer)}
    tokenizer = load_folder_tokenizer(args.model)
    report = {"n": args.n, "models": {"clover": args.model, "peer": args.peer}, "by_messages": []}
    for count in args.messages:
        row = {"messages": count}
        for name, model in models.items():
            scores = evaluate_tasks(
                model, tokenizer, ["no_fly_zones"], args.n, block_size=1, sizes={"no_fly_zones": {"n_messages": count}}
            )["no_fly_zones"]
            row[name] = {key: scores[key] for key in FIELDS}
            print(count, name, row[name], flush=True)
        report["by_messages"].append(row)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for name, style in (("clover", "o-"), ("peer", "s--")):
        for field, color in (("zone_exact_match", "C0"), ("field/lat", "C1")):
            values = [row[name][field] for row in report["by_messages"]]
            axes.plot(args.messages, values, style, color=color, label=f"{name}: {field}")
    axes.set(xscale="log", xlabel="messages per prompt", ylabel="share right", ylim=(0, 1))
    axes.set_xticks(args.messages, [str(m) for m in args.messages])
    axes.set_title(f"no_fly_zones, {args.n} held-out prompts per point")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
