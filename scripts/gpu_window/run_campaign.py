"""`clover campaign` without `cloverlm.cli`, for the GPU machine (run by device.sh, phase 2): the CLI
module imports the server's packages (fastapi, pydantic), which that machine does not have, while the
campaign itself needs only torch, transformers, peft and gguf. Same options and the same call as
cli/make.py's cmd_campaign; prints the campaign's summary as JSON."""

import argparse
import json
import sys

import torch

from cloverlm.training.conversion.campaign import CampaignConfig, run_campaign

parser = argparse.ArgumentParser()
parser.add_argument("--minutes", type=float, required=True)
parser.add_argument("--out", default=CampaignConfig.out)
parser.add_argument("--models", default=CampaignConfig.models)
parser.add_argument("--device", default=CampaignConfig.device, choices=("auto", "cpu", "cuda"))
parser.add_argument("--prompts", type=int, default=CampaignConfig.prompts)
parser.add_argument("--rows-per-step", type=int)
parser.add_argument("--tokens-per-step", type=int)
parser.add_argument("--threads", type=int)
parser.add_argument("--no-eval", action="store_true")
parser.add_argument("--no-promote", action="store_true")
args = parser.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
cfg = CampaignConfig(minutes=args.minutes, out=args.out, models=args.models, device=args.device, prompts=args.prompts,
                     rows_per_step=args.rows_per_step, tokens_per_step=args.tokens_per_step, evaluate=not args.no_eval,
                     promote=not args.no_promote)  # fmt: skip
print(json.dumps(run_campaign(cfg)))
loaded = {name.split(".")[0] for name, module in sys.modules.items() if module is not None} - set(
    sys.stdlib_module_names
)
print(
    "third-party modules loaded:",
    " ".join(sorted(n for n in loaded if not n.startswith("_"))),
    file=sys.stderr,
)
