"""Training curves of the shipped adapters: Clover's noisy-block and clean-stream (B = 1) losses and the
peer's next-token loss, per step (moving mean of 10) and held out (every 50 steps).

Run: python scripts/plot_convert_log.py models/smollm2-clover models/smollm2-peer --out models/convert_training.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]


def moving_mean(values: list[float], width: int = 10) -> list[float]:
    windows = (values[max(0, i - width + 1) : i + 1] for i in range(len(values)))
    return [sum(window) / len(window) for window in windows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for folder in args.folders:
        log = read_log(folder)
        for key, style in (("noisy_nll", "-"), ("ar_nll", "--")):
            rows = [r for r in log if key in r]
            if not rows:
                continue
            label = f"{folder.name} {key}"
            line = axis.plot([r["step"] for r in rows], moving_mean([r[key] for r in rows]), style, label=label)[0]
            held = [r for r in rows if f"eval_{key}" in r]
            axis.plot([r["step"] for r in held], [r[f"eval_{key}"] for r in held], "o", color=line.get_color())
    axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.set_ylabel("NLL per token (moving mean of 10; dots: held out)")
    devices = sorted({json.loads((f / "clover_adapter.json").read_text()).get("device", "device not recorded") for f in args.folders})
    axis.set_title(f"Conversion fine-tuning of SmolLM2-135M-Instruct (LoRA r32, {', '.join(devices)})")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
