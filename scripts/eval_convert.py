"""The conversion issue's evaluation of a converted model (base + adapter), in one run:

* no_fly_zones at 20 messages and tool_call, at block size 1 and at block size 16 (threshold 0.9);
* a threshold sweep at block size 16 on no_fly_zones (TPF and exact match);
* the base's general behaviour: the model's greedy answers at B = 1 on held-out self-distilled chat
  prompts against the base's own (data/chat_distill/heldout.jsonl), as a token agreement rate;
* the peer (an autoregressive folder, or the base itself with --peer base) on the same prompts, also
  with prompt lookup (transformers' prompt_lookup_num_tokens) on no_fly_zones.

Run: python scripts/eval_convert.py --model models/smollm2-clover --n 20 --json models/smollm2-clover/eval.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cloverlm.convert.base import load_base
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.convert.peer import load_peer
from cloverlm.evaluation.chat import chat_agreement, read_chat
from cloverlm.evaluation.evaluate import evaluate_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-clover")
    parser.add_argument("--peer", default="base", help="an autoregressive peer folder, or 'base' (the base zero-shot)")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--peer-n", type=int, default=20, help="held-out prompts per task for the peer")
    parser.add_argument("--peer-lookup", type=int, default=10, help="the peer's prompt_lookup_num_tokens (0: skip that run)")
    parser.add_argument("--sweep-n", type=int, default=5, help="prompts per threshold of the sweep")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9, 0.95])
    parser.add_argument("--chat", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", required=True)
    parser.add_argument("--chat-only", action="store_true", help="recompute only the chat agreement, into an existing --json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.chat_only:
        model, tokenizer = load_model(args.model), load_folder_tokenizer(args.model)
        report = json.loads(Path(args.json).read_text())
        report["chat_agreement_b1"] = chat_agreement(model, tokenizer, read_chat("heldout")[: args.chat])
        print(json.dumps(report["chat_agreement_b1"]), flush=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return
    started = time.time()
    model, tokenizer = load_model(args.model), load_folder_tokenizer(args.model)
    peer = load_base()[0] if args.peer == "base" else load_peer(args.peer)
    sizes = {"no_fly_zones": {"n_messages": 20}}
    tasks = ["no_fly_zones", "tool_call"]
    report: dict = {"model": args.model, "peer_folder": args.peer, "n": args.n, "peer_n": args.peer_n, "peer_lookup": args.peer_lookup, "sweep_n": args.sweep_n}
    report["clover_b1"] = evaluate_tasks(model, tokenizer, tasks, args.n, block_size=1, threshold=1.0, sizes=sizes)
    print(json.dumps(report["clover_b1"]), flush=True)
    report["clover_b16"] = evaluate_tasks(model, tokenizer, tasks, args.n, block_size=16, threshold=0.9, sizes=sizes)
    print(json.dumps(report["clover_b16"]), flush=True)
    report["peer"] = evaluate_tasks(peer, tokenizer, tasks, args.peer_n, sizes=sizes)
    print(json.dumps(report["peer"]), flush=True)
    if args.peer_lookup:
        lookup = evaluate_tasks(peer, tokenizer, ["no_fly_zones"], args.peer_n, sizes=sizes, prompt_lookup=args.peer_lookup)
        report["peer_prompt_lookup"] = lookup
        print(json.dumps(lookup), flush=True)
    report["threshold_sweep_b16"] = {}
    for threshold in args.thresholds:
        result = evaluate_tasks(model, tokenizer, ["no_fly_zones"], args.sweep_n, block_size=16, threshold=threshold, sizes=sizes)
        report["threshold_sweep_b16"][str(threshold)] = result["no_fly_zones"]
        print(threshold, json.dumps(result), flush=True)
    report["chat_agreement_b1"] = chat_agreement(model, tokenizer, read_chat("heldout")[: args.chat])
    print(json.dumps(report["chat_agreement_b1"]), flush=True)
    report["seconds"] = round(time.time() - started)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
