"""The `clover` command line: info, tokenizer, train, generate, eval."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import CloverError

DEFAULT_MODEL = "models/clover-tiny"


def default_model_dir() -> Path:
    """models/clover-tiny of the current folder, else of the source checkout this package runs from."""
    here = Path(DEFAULT_MODEL)
    if here.exists():
        return here
    return Path(__file__).resolve().parents[2] / DEFAULT_MODEL


def _parse_overrides(pairs: list[str]) -> dict:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise CloverError(f"--set expects key=value, got '{pair}'")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def cmd_info(args) -> None:
    from .config import human_count, parameter_counts, preset_config

    config = preset_config(args.preset)
    counts = parameter_counts(config)
    layers = {kind: config.layer_types.count(kind) for kind in dict.fromkeys(config.layer_types)}
    info = {
        **counts,
        "preset": args.preset,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "layer_types": layers,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "vocab_size": config.vocab_size,
    }
    if args.json:
        print(json.dumps(info))
    else:
        print(f"{args.preset}: {human_count(counts['total_params'])} total, {human_count(counts['active_params'])} active")
        for key, value in info.items():
            print(f"  {key}: {value}")


def cmd_tokenizer(args) -> None:
    from .data import build_default_tokenizer

    tokenizer = build_default_tokenizer(vocab_size=args.vocab_size)
    tokenizer.save_pretrained(args.out)
    print(f"tokenizer with {len(tokenizer)} tokens written to {args.out}")


def cmd_train(args) -> None:
    from .train import TrainConfig, Trainer

    cfg = TrainConfig(
        preset=args.preset,
        recipe=args.recipe,
        out=args.out,
        seed=args.seed,
        max_steps=args.max_steps,
        minutes=args.minutes,
        tokenizer=args.tokenizer,
        init_from=args.init_from,
        overrides=_parse_overrides(args.set),
        bf16=not args.fp32,
    )
    for name in ("seq_len", "batch_size", "lr", "eval_every", "checkpoint_every", "probe_examples"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    summary = Trainer(cfg, resume=args.resume).run()
    print(json.dumps(summary))


def _load(args):
    from .checkpoint import load_model
    from .tokenizer import load_tokenizer

    folder = Path(args.model) if args.model else default_model_dir()
    model = load_model(folder)
    return model, load_tokenizer(folder)


def cmd_generate(args) -> None:
    from . import tasks
    from .data import HELDOUT_SEED_BASE
    from .generate import generate
    from .tokenizer import format_chat

    example = None
    if args.task:
        example = tasks.generate(args.task, HELDOUT_SEED_BASE + args.seed)
        print(example.prompt + "\n", file=sys.stderr)
        prompt, tools = example.prompt, list(example.tools)
    elif args.prompt is None or not args.prompt.strip():
        raise CloverError("empty prompt: give some text to continue (or --task NAME)")
    else:
        prompt, tools = args.prompt, []
    model, tokenizer = _load(args)
    text = prompt if args.raw else format_chat(tokenizer, prompt, tools=tools)[0]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stops = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    result = generate(
        model, ids, max_new_tokens=args.max_new_tokens, block_size=args.block_size, threshold=args.threshold, stop_ids=stops
    )
    output = tokenizer.decode(result.tokens)
    print(output)
    if example is not None:
        scores = tasks.get_task(args.task).check(example, output)
        print(json.dumps({"expected": example.answer, "scores": scores}), file=sys.stderr)
    print(
        f"[{len(result.tokens)} tokens, {result.forwards} forwards, {result.tokens_per_forward:.2f} tokens/forward]",
        file=sys.stderr,
    )


def cmd_eval(args) -> None:
    from .evaluate import evaluate_tasks

    model, tokenizer = _load(args)
    report = evaluate_tasks(
        model, tokenizer, args.tasks, args.n, block_size=args.block_size, threshold=args.threshold
    )
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover", description="Block-diffusion MoE language models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts of a preset")
    p.add_argument("preset")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("tokenizer", help="train the default byte-level BPE tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("train", help="block-diffusion training")
    p.add_argument("--preset", default="clover-tiny")
    p.add_argument("--recipe", default="default")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (default: every 5 minutes)")
    p.add_argument("--probe-examples", type=int)
    p.add_argument("--tokenizer", help="a tokenizer folder (default: train the default one)")
    p.add_argument("--init-from", help="start from this model folder's weights and tokenizer (fine-tuning)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--threads", type=int)
    p.add_argument("--fp32", action="store_true", help="disable bf16 autocast")
    p.set_defaults(func=cmd_train)

    for name, func, helptext in (
        ("generate", cmd_generate, "generate text from a prompt"),
        ("eval", cmd_eval, "per-task accuracy on held-out prompts"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", help=f"model folder (default: {DEFAULT_MODEL})")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--threshold", type=float, default=1.0, help="confidence to unmask in parallel (1.0: one per step)")
        p.set_defaults(func=func)
        if name == "generate":
            p.add_argument("prompt", nargs="?")
            p.add_argument("--task", help="use a held-out prompt of this task generator and score the answer")
            p.add_argument("--seed", type=int, default=0, help="which held-out prompt of --task")
            p.add_argument("--max-new-tokens", type=int, default=256)
            p.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
        else:
            p.add_argument("--tasks", nargs="+", default=["no_fly_zones", "tool_call", "kv_retrieval", "arithmetic"])
            p.add_argument("--n", type=int, default=20)
            p.add_argument("--json")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (CloverError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
