"""Training and batch-1 decoding speed of a randomly initialised preset, written as JSON.

    python scripts/gpu_check.py --device cuda --preset clover-1b-a0.3b --seconds 300
    python scripts/gpu_check.py --device cpu --preset clover-tiny --seconds 20     # the same code, slowly

Training: block-diffusion steps (random partitions of the block sizes, per-block masking, the 1/t
ELBO, AdamW) under bf16 autocast with fp32 weights; tokens/s counts x_0 tokens (each also runs as the
noisy stream). Decoding: the Engine with one request, the model cast to bf16. Random weights are
never confident, so the threshold rule unmasks about one token per forward: tokens/s here is close to
forwards/s, and a trained model at T tokens/forward decodes about T times faster (see the
tokens_per_forward and forward_ms fields). Half of --seconds goes to training, 40% to decoding; the
first steps (kernel compilation and autotuning) are run but not timed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

from cloverlm import CloverCache, CloverForBlockDiffusion, preset_config
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.errors import CloverError
from cloverlm.model.config import CHUNK_SIZE
from cloverlm.model.layout import block_partition
from cloverlm.ops import fla_backend
from cloverlm.training.scratch.diffusion import NoisedBatch, diffusion_loss, mask_blocks

BLOCK_SIZES = [1, 4, 8, 16, 32, 64]  # the widest stage of the training recipe's mix


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def memory_backend(device: torch.device) -> str:
    probe = torch.zeros(1, device=device)
    return "fla" if fla_backend.kernel_for(probe) is not None else "torch"


def random_ids(generator, shape, vocab_size: int, reserved: set[int]) -> torch.Tensor:
    ids = torch.randint(0, vocab_size, shape, generator=generator)
    low = max(reserved) + 1  # special ids sit at the start of the vocabulary
    return torch.where(ids < low, ids + low, ids)


def measure_training(model, device, args, generator) -> dict:
    config = model.config
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    reserved = {config.mask_token_id, config.pad_token_id, config.eos_token_id}
    deadline = time.perf_counter() + args.seconds * 0.5
    losses, timed_steps, timed_seconds, step = [], 0, 0.0, 0
    while True:
        sizes = block_partition(args.seq_len, BLOCK_SIZES, generator, chunk=CHUNK_SIZE)
        ids = random_ids(generator, (args.batch_size, args.seq_len + 1), config.vocab_size, reserved)
        eligible = torch.ones_like(ids, dtype=torch.bool)
        noised = mask_blocks(ids, eligible, sizes, config.mask_token_id, generator)
        noised = NoisedBatch(*(getattr(noised, f.name).to(device) for f in fields(noised)))
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            elbo, aux, _ = diffusion_loss(model, noised, sizes)
            loss = elbo + config.router_aux_loss_coef * aux
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.update_router_bias()
        sync(device)
        elapsed = time.perf_counter() - start
        losses.append(float(loss.detach()))
        step += 1
        if step > args.warmup_steps:
            timed_steps += 1
            timed_seconds += elapsed
        if time.perf_counter() > deadline and timed_steps >= 2:
            break
    tokens = args.batch_size * args.seq_len
    result = {
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "block_sizes": BLOCK_SIZES,
        "warmup_steps": args.warmup_steps,
        "timed_steps": timed_steps,
        "step_ms": round(1000 * timed_seconds / timed_steps, 2),
        "tokens_per_s": round(tokens * timed_steps / timed_seconds, 1),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
    }
    if device.type == "cuda":
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del optimizer
    return result


def measure_decoding(model, device, args, generator) -> dict:
    config = model.config
    model = model.to(torch.bfloat16).eval()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    reserved = {config.mask_token_id, config.pad_token_id, config.eos_token_id}
    deadline = time.perf_counter() + args.seconds * 0.4  # the warm-up below spends from the same budget
    engine = Engine(model, max_batch_size=1)
    params = DecodeParams(max_new_tokens=args.new_tokens, block_size=args.block_size, threshold=args.threshold)
    # One untimed request compiles and autotunes the kernels at these shapes.
    warm = random_ids(generator, (args.prompt_tokens,), config.vocab_size, reserved).tolist()
    engine.generate([Request(warm, DecodeParams(max_new_tokens=2 * args.block_size, block_size=args.block_size))])
    with torch.no_grad():
        prompt = random_ids(generator, (1, args.prompt_tokens), config.vocab_size, reserved).to(device)
        sync(device)
        start = time.perf_counter()
        model.prefill(prompt, [args.block_size] * (args.prompt_tokens // args.block_size), CloverCache.empty(config, 1, device=device))
        sync(device)
        prefill_ms = 1000 * (time.perf_counter() - start)
    tokens = forwards = requests = 0
    seconds = 0.0
    while time.perf_counter() < deadline or requests == 0:
        prompt_ids = random_ids(generator, (args.prompt_tokens,), config.vocab_size, reserved).tolist()
        start = time.perf_counter()
        [completion] = engine.generate([Request(prompt_ids, params)])
        sync(device)
        seconds += time.perf_counter() - start
        tokens += len(completion.tokens)
        forwards += completion.forwards
        requests += 1
    result = {
        "prompt_tokens": args.prompt_tokens,
        "block_size": args.block_size,
        "threshold": args.threshold,
        "requests": requests,
        "tokens": tokens,
        "forwards": forwards,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "forwards_per_s": round(forwards / seconds, 2),
        "forward_ms": round(1000 * seconds / max(forwards, 1), 3),
        "tokens_per_forward": round(tokens / max(forwards, 1), 3),
        "prefill_ms": round(prefill_ms, 2),
        "note": "includes each request's prefill; random weights unmask about one token per forward",
    }
    if device.type == "cuda":
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def default_out(device: torch.device) -> Path:
    name = "cpu" if device.type == "cpu" else re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return Path("bench/results") / f"{dt.date.today().isoformat()}-{name}.json"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="clover-1b-a0.3b")
    parser.add_argument("--seconds", type=float, default=300.0, help="measuring budget (model building not included)")
    parser.add_argument("--batch-size", type=int, default=None, help="training rows (cuda 4, cpu 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="training tokens per row (cuda 2048, cpu 256)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pytest-summary", default=None, help="the CUDA tests' closing line, kept in the JSON")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/<date>-<gpu>.json)")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CloverError("--device cuda but torch sees no CUDA device")
        if args.seconds <= 0:
            raise CloverError(f"--seconds must be positive, got {args.seconds}")
    except (CloverError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    cuda = device.type == "cuda"
    args.batch_size = args.batch_size or (4 if cuda else 2)
    args.seq_len = args.seq_len or (2048 if cuda else 256)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    config = preset_config(args.preset)
    built = time.perf_counter()
    with device:
        model = CloverForBlockDiffusion(config)
    build_seconds = time.perf_counter() - built
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "fla": fla_backend.fla_version(),
        "memory_kernel": memory_backend(device),
        "preset": args.preset,
        "params": sum(p.numel() for p in model.parameters()),
        "build_seconds": round(build_seconds, 1),
        "tests": args.pytest_summary,
    }
    print(json.dumps(result), file=sys.stderr)
    result["train"] = measure_training(model, device, args, generator)
    print(json.dumps(result["train"]), file=sys.stderr)
    result["decode"] = measure_decoding(model, device, args, generator)
    out = args.out or default_out(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
