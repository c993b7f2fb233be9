"""Training throughput of the conversion trainer: tokens per second and the share of time in attention.

    .venv/bin/python scripts/train_throughput.py --steps 4 --threads 2                 # this CPU, one row
    .venv/bin/python scripts/train_throughput.py --threads 2 --variants fp32-dense-batched-peftrows,default
    .venv/bin/python scripts/train_throughput.py --device cuda --rows-per-step 8 --tokens-per-step 4000
    .venv/bin/python scripts/train_throughput.py --device cuda --rows-per-step 8 --pad-multiple 1   # unpadded

Runs real optimizer steps of `ConvertTrainer` on the batches of steps 0..N (built before timing), times
each after --warmup steps, and profiles one more with torch.profiler. Tokens are the real ones (clean
positions + noisy slots, padding excluded): the figure the trainer's lineage counts. Prints one JSON line
per variant.

--variants compares trainers in one process, step by step interleaved, each on its own copy of the
model and the same batches: `default` (what the trainer chooses on this machine), or a name of parts
`fp32` | `bf16`, `dense` | `segmented` (attention: one mask over both streams, or only what it allows),
`castbase` (autocast casts the fp32 frozen base every forward instead of holding it in bf16) and
`batched` (a step's rows padded into one forward, not one row at a time), `peftrows` (peft's
trainable-token forward, which rebuilds the tied 49152 x 576 matrix every call, and the output head cast
every forward: frozen_base.token_rows_apart undone), `drawsN` (N masks drawn per
answer block: ConvertConfig.noisy_draws). `fp32-dense-batched-peftrows` is the trainer before these choices
existed (main at 135493c) on a CPU. Each variant's tokens are its own batches' (draws add noisy slots).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from cloverlm.training.conversion.frozen_base import frozen_linears_to
from cloverlm.training.conversion.trainer import ConvertConfig, ConvertTrainer
from cloverlm.training.loop import resident_gib

ATTENTION_OPS = ("attention", "sdpa", "flash", "cudnn_attn")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_share(trainer: ConvertTrainer, batch) -> dict:
    """Self time of attention kernels over all self time, one profiled step (device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.train_step(0, batch)
        synchronize(trainer.device)
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events)
    attention = sum(getattr(e, attr) for e in events if any(k in e.key.lower() for k in ATTENTION_OPS))
    top = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:5]
    return {"attention_share": round(attention / max(total, 1), 3), "profiled_ms": round(total / 1e3, 1),
            "top_ops": [(e.key, round(getattr(e, attr) / 1e3, 1)) for e in top]}  # fmt: skip


def build_trainer(args, out: str, variant: str) -> ConvertTrainer:
    parts = set(variant.split("-"))
    draws = [int(p[5:]) for p in parts if p.startswith("draws") and p[5:].isdigit()]
    parts -= {f"draws{n}" for n in draws}
    unknown = parts - {"default", "fp32", "bf16", "dense", "segmented", "castbase", "batched", "peftrows"}
    if unknown:
        raise SystemExit(f"unknown variant parts {sorted(unknown)} in {variant!r}")
    bf16 = True if "bf16" in parts else False if "fp32" in parts else None
    cfg = ConvertConfig(out=out, device=args.device, tokens_per_step=args.tokens_per_step, rows_per_step=args.rows_per_step,
                        pad_multiple=args.pad_multiple, compile=args.compile, objective=args.objective, bf16=bf16,
                        noisy_draws=draws[0] if draws else 1, max_steps=args.warmup + args.steps + 1)  # fmt: skip
    trainer = ConvertTrainer(cfg)
    if "dense" in parts or "segmented" in parts:
        trainer.segmented = "segmented" in parts
    if "batched" in parts:
        trainer.row_by_row = False
    if "castbase" in parts:  # the frozen base back in fp32 (the values were bf16-rounded: timing only)
        frozen_linears_to(trainer.model, torch.float32)
    if "peftrows" in parts:  # the class's forward again wherever token_rows_apart set one on the instance
        for module in trainer.model.modules():
            module.__dict__.pop("forward", None)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (kernel plans, compile)")
    parser.add_argument("--tokens-per-step", type=int, default=1600, help="clean tokens per row")
    parser.add_argument("--rows-per-step", type=int, default=1)
    parser.add_argument("--pad-multiple", type=int, help="default: the trainer's (256 on CUDA, none on CPU)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--objective", default="diffusion", choices=("diffusion", "ar"))
    parser.add_argument("--threads", type=int)
    parser.add_argument("--variants", default="default", help="comma-separated trainers to interleave (see above)")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as out:
        trainers = {v: build_trainer(args, f"{out}/{i}", v) for i, v in enumerate(variants)}
        first = next(iter(trainers.values()))
        n = args.warmup + args.steps + 1
        batches = {}
        for v, trainer in trainers.items():  # the same examples and masks; segments only where used
            batches[v] = [trainer.data.step_batch(step, trainer.pad_multiple, trainer.segmented) for step in range(n)]
        seconds = {v: [] for v in variants}
        tokens, noisy, padded = ({v: [] for v in variants} for _ in range(3))
        for index in range(n - 1):
            for v, trainer in trainers.items():  # interleaved: the machine's drift touches every variant alike
                synchronize(trainer.device)
                started = time.perf_counter()
                trainer.train_step(index, batches[v][index])
                synchronize(trainer.device)
                if index >= args.warmup:
                    seconds[v].append(time.perf_counter() - started)
            for v in variants if index >= args.warmup else ():
                batch, ar = batches[v][index], args.objective == "ar"
                counts = batch.token_counts()
                tokens[v].append(counts["clean"] + (0 if ar else counts["noisy"]))
                noisy[v].append(0 if ar else counts["noisy"])
                padded[v].append(batch.clean_ids.numel() + (0 if ar else batch.noisy.input_ids.numel()))
        base_rate = None
        for v, trainer in trainers.items():
            rates = [t / s for t, s in zip(tokens[v], seconds[v])]
            rate = statistics.median(rates)
            base_rate = base_rate or rate
            report = {
                "variant": v, "device": trainer.lineage()["device"], "cpu": cpu_name(), "objective": args.objective,
                "rows_per_step": args.rows_per_step, "tokens_per_step": args.tokens_per_step,
                "pad_multiple": trainer.pad_multiple, "compile": args.compile, "bf16": trainer.bf16,
                "segmented": trainer.segmented, "steps": args.steps,
                "median_step_s": round(statistics.median(seconds[v]), 3), "median_tokens_per_s": round(rate),
                "median_noisy_tokens_per_s": round(statistics.median(n / s for n, s in zip(noisy[v], seconds[v]))),
                "speedup_vs_first": round(rate / base_rate, 2), "mean_tokens_per_step": round(statistics.mean(tokens[v])),
                "padding_share": round(1 - sum(tokens[v]) / sum(padded[v]), 3),
            }  # fmt: skip
            if not args.no_profile:
                report |= attention_share(trainer, batches[v][-1])
            print(json.dumps(report), flush=True)
        if first.device.type == "cuda":
            print(json.dumps({"peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}))
        print(json.dumps({"peak_resident_gib": resident_gib()[1]}))


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
