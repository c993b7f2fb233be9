"""Where a decoding forward's time goes on this machine: one denoising forward per block size, behind a
prompt as long as the demo's, in each dtype the engine could decode in, then the heaviest operators of
one forward (torch.profiler). A diagnostic for the demo's speed (issue 29), not a benchmark: run it
alone on the machine; `clover bench` measures speed.

  .venv/bin/python scripts/profile_decode.py --context 1000 --sizes 1 4 16 32 --threads 2
"""

import argparse
import json
import platform

import torch
from torch.profiler import ProfilerActivity, profile

from cloverlm.convert.load import load_model
from cloverlm.decoding.calibration import Calibration
from cloverlm.model.cache import CloverCache
from cloverlm.model.checkpoint import inference_dtype
from cloverlm.model.layout import fixed_partition
from cloverlm.training.calibrate import measure_forward_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-clover")
    p.add_argument("--context", type=int, default=1000, help="prompt tokens before the block (the demo: ~1,000)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile-size", type=int, default=16, help="the block size whose operators are listed")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    report = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "context": args.context,
              "engine_dtype": str(inference_dtype("cpu")), "forward_ms": {}}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(args.model, dtype)
        times = measure_forward_ms(model, args.sizes, context=args.context, repeats=args.repeats)
        report["forward_ms"][str(dtype)] = dict(zip(args.sizes, times))
        print(str(dtype), dict(zip(args.sizes, times)), flush=True)
    model = load_model(args.model, inference_dtype("cpu"))
    cache = CloverCache.empty(model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context))
    with torch.no_grad():
        model.prefill(ids, fixed_partition(args.context, Calibration.prefill_block_size), cache)
        block = torch.full((1, args.profile_size), model.config.mask_token_id)
        model.decode(cache, step_ids=block)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model.decode(cache, step_ids=block)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print(table)
    report["operators"] = [
        {"name": e.key, "self_ms": round(e.self_cpu_time_total / 1000 / 3, 3), "calls": e.count // 3}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
    ]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
