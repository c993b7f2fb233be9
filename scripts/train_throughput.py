"""Training throughput of the conversion trainer: tokens per second and the share of time in attention.

    .venv/bin/python scripts/train_throughput.py --steps 4 --threads 2                 # this CPU, one row
    .venv/bin/python scripts/train_throughput.py --device cuda --rows-per-step 8 --tokens-per-step 4000
    .venv/bin/python scripts/train_throughput.py --device cuda --rows-per-step 8 --pad-multiple 1   # unpadded

Runs real optimizer steps of `ConvertTrainer` on the batches of steps 0..N (built before timing), times
each after --warmup steps, and profiles one more with torch.profiler. Tokens are the real ones (clean
positions + noisy slots, padding excluded): the figure the trainer's lineage counts. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from cloverlm.training.convert import ConvertConfig, ConvertTrainer

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
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = ConvertConfig(out=out, device=args.device, tokens_per_step=args.tokens_per_step, rows_per_step=args.rows_per_step,
                            pad_multiple=args.pad_multiple, compile=args.compile, objective=args.objective,
                            max_steps=args.warmup + args.steps + 1)  # fmt: skip
        trainer = ConvertTrainer(cfg)
        batches = [trainer.data.step_batch(step, trainer.pad_multiple) for step in range(args.warmup + args.steps + 1)]
        seconds, tokens, padded = [], [], []
        for index, batch in enumerate(batches[:-1]):
            synchronize(trainer.device)
            started = time.perf_counter()
            trainer.train_step(index, batch)
            synchronize(trainer.device)
            if index >= args.warmup:
                counts = batch.token_counts()
                seconds.append(time.perf_counter() - started)
                tokens.append(counts["clean"] + (counts["noisy"] if args.objective == "diffusion" else 0))
                padded.append(batch.clean_ids.numel() + (batch.noisy.input_ids.numel() if args.objective == "diffusion" else 0))
        rates = [t / s for t, s in zip(tokens, seconds)]
        report = {
            "device": trainer.lineage()["device"], "objective": args.objective, "rows_per_step": args.rows_per_step,
            "tokens_per_step": args.tokens_per_step, "pad_multiple": trainer.pad_multiple, "compile": args.compile,
            "bf16": trainer.bf16, "steps": args.steps, "median_step_s": round(statistics.median(seconds), 3),
            "median_tokens_per_s": round(statistics.median(rates)), "mean_tokens_per_step": round(statistics.mean(tokens)),
            "padding_share": round(1 - sum(tokens) / sum(padded), 3),
        }  # fmt: skip
        if not args.no_profile:
            report |= attention_share(trainer, batches[-1])
        if trainer.device.type == "cuda":
            report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
