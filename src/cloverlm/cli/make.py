"""The `clover` commands that make a model: info (a preset's size and memory plan), tokenizer, train
(from scratch, or --recipe convert: a LoRA adapter over a pretrained base), convert and graft-select."""

from __future__ import annotations

import json
from pathlib import Path

from cloverlm.errors import CloverError


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
    from cloverlm.training.scratch.data import build_default_tokenizer

    tokenizer = build_default_tokenizer(vocab_size=args.vocab_size)
    tokenizer.save_pretrained(args.out)
    print(f"tokenizer with {len(tokenizer)} tokens written to {args.out}")


def cmd_train(args) -> None:
    if args.recipe in ("convert", "distill"):
        return _train_convert(args)
    if args.recipe in ("graft-stage1", "graft-stage2"):
        return _train_graft(args)
    from cloverlm.training.scratch.recipe import TrainConfig
    from cloverlm.training.scratch.train import Trainer

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
        bf16=False if args.fp32 else None,
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
    """--recipe convert: a LoRA adapter over a converted pretrained base (training/conversion/trainer.py); --recipe
    distill: the model's own right answers first (training/conversion/distill.py), then training on them."""
    import torch

    from cloverlm.training.conversion.trainer import ConvertConfig, ConvertTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    fields = {"base": args.base, "seed": args.seed, "objective": "ar" if args.arch == "ar" else "diffusion"}
    for name in ("max_steps", "minutes", "lr", "eval_every", "checkpoint_every", "device", "tokens_per_step",
                 "rows_per_step", "pad_multiple", "warmup_steps", "noisy_draws", "certainty_weight", "init_adapter"):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    if args.compile:
        fields["compile"] = True
    if args.fp32:
        fields["bf16"] = False
    if args.recipe == "distill":
        cfg = _distill_trajectories(args, fields)
    else:
        cfg = ConvertConfig(out=args.out, **fields)
    print(json.dumps(ConvertTrainer(cfg, resume=args.resume).run()))


def _train_graft(args) -> None:
    """--recipe graft-stage1: the grafted memory layers of --student fitted, layer by layer, to --teacher's
    attention (training/graft/stage1.py); graft-stage2: the whole student on logit KL against --teacher
    (training/graft/stage2.py)."""
    import torch

    from cloverlm.training.graft.stage1 import GraftStage1, Stage1Config
    from cloverlm.training.graft.stage2 import GraftStage2, Stage2Config

    if not args.teacher or not args.student:
        raise CloverError(f"--recipe {args.recipe} needs --teacher DIR and --student DIR (clover convert --graft memory)")
    if args.threads:
        torch.set_num_threads(args.threads)
    stage, config = (GraftStage1, Stage1Config) if args.recipe == "graft-stage1" else (GraftStage2, Stage2Config)
    fields = {"teacher": args.teacher, "student": args.student, "out": args.out, "seed": args.seed}
    if args.data_weight is not None:
        if args.recipe != "graft-stage2":
            raise CloverError("--data-weight goes with --recipe graft-stage2")
        fields["data_weight"] = args.data_weight
    for name in ("max_steps", "minutes", "seq_len", "rows_per_step", "lr", "warmup_steps", "checkpoint_every", "device"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    if args.fp32:
        fields["bf16"] = False
    if args.publish:
        fields["publish"] = args.publish
    if args.layers is not None:
        fields["layers"] = list(_numbers(args.layers, int, "--layers"))
    print(json.dumps(stage(config(**fields), resume=args.resume).run()))


def _distill_trajectories(args, fields):
    """--recipe distill: append the init adapter's one-token-a-step answers to OUT/trajectories.jsonl
    (resumable), then the distillation config."""
    from cloverlm.convert.load import load_folder_tokenizer, load_model
    from cloverlm.model.checkpoint import inference_dtype
    from cloverlm.training.conversion.distill import TRAJECTORIES, distill_config, make_trajectories
    from cloverlm.training.conversion.trainer import ConvertConfig

    if not args.init_adapter:
        raise CloverError("--recipe distill needs --init-adapter DIR: the adapter whose own answers it distils")
    if fields["objective"] != "diffusion":
        raise CloverError("--recipe distill trains Clover adapters only (not --arch ar)")
    cfg = distill_config(out=args.out, **fields)
    model = load_model(Path(args.init_adapter), inference_dtype())
    summary = make_trajectories(
        model, load_folder_tokenizer(Path(args.init_adapter)), Path(args.out) / TRAJECTORIES, args.trajectories,
        ConvertConfig().mixture, seed=args.seed,
    )  # fmt: skip
    print(json.dumps({"trajectories": summary}))
    return cfg


def cmd_campaign(args) -> None:
    """The training campaign (training/conversion/campaign.py): Clover and its peer on the same batches, evaluated
    against the shipped pair and promoted where they beat it."""
    from cloverlm.training.conversion.campaign import run_from_args

    print(json.dumps(run_from_args(args)))


def cmd_convert(args) -> None:
    """A pretrained base as an ordinary Clover model folder (before any fine-tuning: the base at B = 1)."""
    from cloverlm.convert.base import converted
    from cloverlm.convert.qwen import convert_qwen, is_qwen_folder
    from cloverlm.model.checkpoint import save_model

    if args.graft:
        return _graft(args)
    if args.source or args.memory_layers:
        raise CloverError("--source and --memory-layers go with --graft memory")
    if is_qwen_folder(args.base):  # a Qwen3.5-MoE folder has its own converter (convert/qwen.py)
        convert_qwen(args.base, args.out)
        print(f"{args.base} (Qwen3.5-MoE) converted into {args.out}")
        return
    model, tokenizer = converted(args.base)
    save_model(model, tokenizer, Path(args.out))
    print(f"{args.base} converted: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {args.out}")


def _graft(args) -> None:
    """--graft memory: a Clover folder (or --base, converted) with memory layers in place of attention layers."""
    from cloverlm.convert.base import converted
    from cloverlm.convert.graft import attention_layers, graft_with_calibration
    from cloverlm.convert.load import load_folder_tokenizer, load_model
    from cloverlm.model.checkpoint import save_model

    if args.source:
        model, tokenizer = load_model(Path(args.source)), load_folder_tokenizer(Path(args.source))
    else:
        model, tokenizer = converted(args.base)
    if args.memory_layers is None:
        layers = None
    elif args.memory_layers.strip().lower() == "all":  # every attention layer: the all-memory student of stage 1
        layers = attention_layers(model.config)
    else:
        layers = list(_numbers(args.memory_layers, int, "--memory-layers"))
    graft, layers = graft_with_calibration(model, tokenizer, layers)
    save_model(graft, tokenizer, Path(args.out))
    kept = attention_layers(graft.config)  # a graft's own source may be one
    print(f"{args.source or args.base} grafted: {len(layers)} new memory layers, attention kept at {kept}, "
          f"{sum(p.numel() for p in graft.parameters()) / 1e6:.1f}M parameters in {args.out}")  # fmt: skip


def _numbers(text: str, kind, option: str) -> tuple:
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CloverError(f"{option} expects comma-separated numbers, got '{text}'") from None


def _select_config(args, **fields):
    """graft-select's and graft-eval's SelectConfig from their shared options (cli probe_arguments)."""
    import torch

    from cloverlm.training.graft.select import SelectConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    depths = _numbers(args.needle_depths, float, "--needle-depths")
    if any(not 0 <= d <= 1 for d in depths):
        raise CloverError(f"--needle-depths must lie between 0 and 1, got {args.needle_depths}")
    return SelectConfig(
        teacher=args.teacher, out=args.out, seed=args.seed, tokens=args.tokens, seq_len=args.seq_len, kv_prompts=args.kv_prompts,
        needle_contexts=_numbers(args.needle_context, int, "--needle-context"), needle_depths=depths, device=args.device,
        bf16=False if args.fp32 else None, **fields,
    )  # fmt: skip


def cmd_graft_select(args) -> None:
    """Which candidate layers of a graft stay attention (training/graft/select.py); prints the summary."""
    from cloverlm.training.graft.select import REPORT_FILE, select_layers

    cfg = _select_config(args, student=args.student, keep=args.keep, save_hybrid=args.save_hybrid)
    report = select_layers(cfg)
    print(json.dumps({"chosen": report["chosen"], "attention_layers": report["attention_layers"],
                      "memory_layers": report["memory_layers_arg"], "report": str(Path(args.out) / REPORT_FILE),
                      "hybrid": report.get("hybrid"),
                      "convert": f"clover convert --graft memory --source {args.teacher} --memory-layers "
                                 f"{report['memory_layers_arg']} --out OUT"}))  # fmt: skip


def cmd_graft_eval(args) -> None:
    """Grafted students' KL and recall against their teacher (training/graft/select.py); prints the table."""
    from cloverlm.training.graft.select import EVAL_FILE, evaluate_students

    report = evaluate_students(_select_config(args), args.students)
    keys = ("kl", "kv", "needle", "recall", "recall_of_teacher")
    print(json.dumps({"teacher": report["teacher_scores"], "report": str(Path(args.out) / EVAL_FILE),
                      "students": [{"student": r["student"], **{k: r[k] for k in keys}} for r in report["students"]]}))
