"""The `clover` command line: info, tokenizer, convert, train, graft-select, graft-eval, generate, eval, calibrate, bench, demo, serve.

This module holds the argument parser and main; the commands are make.py (info, tokenizer, train,
convert, graft-select, graft-eval) and use.py (the commands that run a model folder). They import their machinery inside the
command functions, so that `clover --help` does not load it. A default another module owns is read
from it (DecodeParams, ServerConfig, BenchOptions, calibrate, the packaged bases), not written again here."""

from __future__ import annotations

import argparse
import sys

from cloverlm.bench.options import BenchOptions
from cloverlm.cli.make import (
    cmd_campaign,
    cmd_convert,
    cmd_graft_eval,
    cmd_graft_select,
    cmd_info,
    cmd_tokenizer,
    cmd_train,
)
from cloverlm.cli.use import (
    DEFAULT_MODEL,
    DEFAULT_PEER,
    cmd_bench,
    cmd_calibrate,
    cmd_demo,
    cmd_eval,
    cmd_generate,
    cmd_serve,
)
from cloverlm.convert.base import BASES, DEFAULT_BASE
from cloverlm.decoding.grounding import ANSWER_MODES, DEFAULT_ANSWERS
from cloverlm.decoding.params import DecodeParams
from cloverlm.demo.messages import GENERATED_MESSAGES
from cloverlm.errors import CloverError
from cloverlm.model import plan
from cloverlm.serving.schemas import ServerConfig
from cloverlm.tasks import HELD_OUT, SUITE
from cloverlm.training import calibrate
from cloverlm.training.conversion import campaign
from cloverlm.training.graft.select import SelectConfig
from cloverlm.training.scratch.data import DEFAULT_VOCAB_SIZE
from cloverlm.training.scratch.recipe import TrainConfig


def _block_size(value: str):
    """--block-size: an integer, or "auto" (the model's calibration head picks each block's size)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def _add_answers(p: argparse.ArgumentParser, several: bool = False) -> None:
    """How answers with a schema are decoded (decoding/grounding.py): grounded by default; --plain-schema,
    --free; `several` (clover eval) also takes --answers with modes side by side."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--free", dest="answers", action="store_const", const=["free"], help="decode without the answers' schemas")
    group.add_argument("--plain-schema", dest="answers", action="store_const", const=["schema"],
                       help="decode under the schemas without their grounding (values need not stand in the prompt)")
    if several:
        group.add_argument("--answers", nargs="+", choices=ANSWER_MODES, help="modes reported side by side, e.g. free schema grounded")
    p.set_defaults(answers=[DEFAULT_ANSWERS])


def _contexts(tokens) -> str:
    """Context lengths as --contexts takes them: 1024 -> "1k"."""
    return " ".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover", description="Block-diffusion MoE language models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts of a preset (--plan N: memory per GPU on N GPUs)")
    p.add_argument("preset")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plan", type=int, metavar="N_GPUS", help="per-GPU memory for FSDP training and expert-parallel serving")
    p.add_argument("--seq-len", type=int, default=plan.PLAN_SEQ_LEN, help="--plan: training tokens per GPU per micro-batch")
    p.add_argument("--context", type=int, default=plan.PLAN_CONTEXT, help="--plan: serving context per request, in tokens")
    p.add_argument("--gpu-gib", type=float, default=plan.PLAN_GPU_GIB, help="--plan: GPU memory for the requests-per-GPU figure")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("tokenizer", help="train the default byte-level BPE tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("train", help="block-diffusion training")
    p.add_argument("--preset", default=TrainConfig.preset)
    p.add_argument("--recipe", default=TrainConfig.recipe, choices=("default", "convert", "distill", "graft-stage1", "graft-stage2"),
                   help="default (from scratch), convert (LoRA over --base), distill (an adapter's own right answers) or "
                        "graft-stage1 (a graft's memory layers fitted to --teacher's attention, layer by layer), "
                        "graft-stage2 (then the whole graft on logit KL against --teacher)")
    p.add_argument("--base", default=DEFAULT_BASE, help="--recipe convert: a packaged base or a model folder")
    p.add_argument(
        "--arch", default=TrainConfig.arch,
        help="clover; qwen3.5-moe: the same-size autoregressive peer on the same data; with --recipe convert, ar: the base fine-tuned autoregressively (the peer)",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-every", type=int, help="held-out evaluation every N steps and at the end (0: none)")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (default: every 5 minutes)")
    p.add_argument("--probe-examples", type=int)
    p.add_argument("--tokenizer", help="a tokenizer folder (default: train the default one)")
    p.add_argument("--init-from", help="start from this model folder's weights and tokenizer (fine-tuning)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--threads", type=int)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast (default: bf16 where the hardware multiplies it: CUDA, AVX512-BF16, AMX)")
    g = p.add_argument_group("--recipe convert and distill")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto: cuda when available")
    g.add_argument("--tokens-per-step", type=int, help="clean tokens packed into each row")
    g.add_argument("--rows-per-step", type=int, help="packed rows per step (default 1)")
    g.add_argument("--pad-multiple", type=int, help="pad rows to a multiple of this (default: 256 on CUDA, none on CPU)")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--init-adapter", help="start from this adapter folder (fresh optimizer and warm-up)")
    g.add_argument("--noisy-draws", type=int, help="masks drawn per answer block, each with its complement (default 1)")
    g.add_argument("--certainty-weight", type=float, help="certainty forcing on right noisy predictions (distill: 0.5)")
    g.add_argument("--trajectories", type=int, default=256, help="--recipe distill: prompts answered one token a step")
    g = p.add_argument_group("--recipe graft-stage1 and graft-stage2 (also --seq-len, --rows-per-step, --lr, --warmup-steps, --device, --fp32)")
    g.add_argument("--teacher", help="the all-attention model the student was grafted from (a Clover or adapter folder)")
    g.add_argument("--student", help="the graft (clover convert --graft memory) or a graft folder; --resume continues the "
                                     "checkpoint in --out, else the stage's run that a graft folder records")
    g.add_argument("--publish", help="write the student as a graft folder (its mixers over --teacher, convert/graft_folder.py) "
                                     "with every checkpoint, e.g. models/smollm2-clover-hybrid")
    g.add_argument("--data-weight", type=float, help="graft-stage2: the text's own cross-entropy beside the KL (default 0)")
    g.add_argument("--layers", help="comma-separated grafted layers that train (default: every memory layer in place of "
                                    "a teacher's attention), e.g. the layers grafted after stage 1 trained the others")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("campaign", help="train the shipped pair further, evaluate, promote what beats it (resumable)")
    campaign.add_arguments(p)
    p.set_defaults(func=cmd_campaign)

    p = sub.add_parser("convert", help="a pretrained autoregressive base as a Clover model folder")
    p.add_argument("--base", default=DEFAULT_BASE, help=f"a packaged base ({', '.join(BASES)}), a Llama folder or a Qwen3.5-MoE folder")
    p.add_argument("--out", required=True)
    p.add_argument("--graft", choices=("memory",), help="memory: replace attention layers by memory layers started from them (convert/graft.py)")
    p.add_argument("--source", help="--graft: the Clover folder to graft (weights or adapter; default: --base, converted)")
    p.add_argument("--memory-layers", help="--graft: comma-separated layer indices, or all: every attention layer "
                                           "(default: all but every fourth)")
    p.set_defaults(func=cmd_convert)

    select = SelectConfig()

    def probe_arguments(p):
        """The probes and the machine of graft-select and graft-eval (training/graft/select.py)."""
        p.add_argument("--teacher", required=True, help="the all-attention model the student was grafted from")
        p.add_argument("--out", required=True, help="folder for the report")
        p.add_argument("--tokens", type=int, default=select.tokens, help=f"held-out tokens of the KL (default: {select.tokens})")
        p.add_argument("--seq-len", type=int, default=select.seq_len, help=f"tokens per KL row (default: {select.seq_len})")
        p.add_argument("--kv-prompts", type=int, default=select.kv_prompts, help=f"kv_retrieval prompts (default: {select.kv_prompts})")
        p.add_argument("--needle-context", default=",".join(map(str, select.needle_contexts)),
                       help="comma-separated haystack lengths in tokens (default: %(default)s; 'none': no needle)")
        p.add_argument("--needle-depths", default=",".join(map(str, select.needle_depths)),
                       help="comma-separated depths of the needle, 0 to 1 (default: %(default)s)")
        p.add_argument("--seed", type=int, default=select.seed)
        p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=select.device)
        p.add_argument("--fp32", action="store_true", help="no bf16 (default: bf16 where the hardware multiplies it)")
        p.add_argument("--threads", type=int)

    p = sub.add_parser("graft-select", help="which layers of a graft stay attention: each restored in turn, scored on KL and recall")
    probe_arguments(p)
    p.add_argument("--student", required=True, help="the graft after stage 1 (all or mostly memory layers)")
    p.add_argument("--keep", type=int, default=select.keep, help=f"candidates kept as attention (default: {select.keep})")
    p.add_argument("--save-hybrid", action="store_true",
                   help="also write OUT/hybrid: the student with the chosen layers restored, its trained memory layers kept")
    p.set_defaults(func=cmd_graft_select)

    p = sub.add_parser("graft-eval", help="grafted students' held-out KL against their teacher, and their recall beside its")
    probe_arguments(p)
    p.add_argument("--students", nargs="+", required=True, help="graft folders of --teacher (e.g. all-memory and hybrid)")
    p.set_defaults(func=cmd_graft_eval)

    p = sub.add_parser("calibrate", help="fit the block-size head (block_size='auto') on held-out prompts")
    p.add_argument("--model", help=f"model folder (default: {DEFAULT_MODEL}); the calibration is saved into it")
    p.add_argument("--threshold", type=float, default=DecodeParams.threshold)
    p.add_argument("--fit-prompts", type=int, default=calibrate.FIT_PROMPTS)
    p.add_argument("--eval-prompts", type=int, default=calibrate.EVAL_PROMPTS)
    p.add_argument("--max-new-tokens", type=int, default=calibrate.MAX_NEW_TOKENS)
    p.add_argument("--costs-only", action="store_true",
                   help="keep the fitted heads and time the step costs again on this machine (seconds, not minutes)")
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
            p.add_argument("--max-new-tokens", type=int, default=DecodeParams.max_new_tokens)
            p.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
            p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
            p.add_argument("--strategy", default=DecodeParams.strategy, help="threshold (Fast-dLLM) or low_confidence (LLaDA)")
            p.add_argument("--temperature", type=float, default=DecodeParams.temperature)
            p.add_argument("--sampling-seed", type=int, help="seed for sampling (temperature > 0)")
        else:
            p.add_argument("--tasks", nargs="+", default=[*SUITE, *HELD_OUT])
            p.add_argument("--n", type=int, default=20)
            p.add_argument("--messages", type=int, help="air-traffic messages per no_fly_zones prompt (default 20)")
            _add_answers(p, several=True)
            p.add_argument("--json")

    bench, quick = BenchOptions(), BenchOptions.quick()
    p = sub.add_parser("bench", help="Clover against its autoregressive peer: accuracy, latency, context scaling")
    p.add_argument("--model", help=f"Clover model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--peer", help=f"the autoregressive peer's folder (default: models/{DEFAULT_PEER})")
    p.add_argument("--no-peer", action="store_true", help="Clover only; the peer's fields are null")
    p.add_argument("--memory-model", help="memory-only model for context scaling (default: a random-init clover-tiny-memory)")
    p.add_argument("--hybrid", metavar="FOLDER",
                   help="a grafted hybrid (clover convert --graft memory): context scaling times its block forward beside Clover's "
                        "and reports both models' cache bytes per request")
    p.add_argument("--quick", action="store_true", help=f"under 3 minutes on a 2-core CPU: fewer prompts, {quick.repeats} repeat, {_contexts(quick.contexts)}")
    p.add_argument("--json", default="runs/bench.json", help="the report; its plots go next to it (default: runs/bench.json)")
    p.add_argument("--repeats", type=int, help=f"timed runs of each request (default: {bench.repeats}; --quick: {quick.repeats})")
    p.add_argument("--prompts", type=int, help=f"held-out prompts spread over the tasks (default: {bench.prompts}; --quick: {quick.prompts})")
    p.add_argument("--threads", type=int)
    p.add_argument("--block-size", type=int, default=bench.block_size)
    p.add_argument("--threshold", type=float, default=bench.threshold)
    p.add_argument("--contexts", nargs="+", metavar="N", help=f"context lengths (default: {_contexts(bench.contexts)})")
    p.add_argument("--draft", action="store_true", help="Clover fills blocks with prompt-lookup drafts (all-attention models)")
    _add_answers(p)
    p.add_argument("--sections", nargs="+", metavar="NAME", help=f"run only these sections (default: all: {' '.join(bench.sections)})")
    p.add_argument("--sweep-prompts", type=int, help=f"{bench.sweep_task} prompts of the block-size and threshold sweeps (default: {bench.sweep_prompts})")
    p.add_argument("--schema-prompts", type=int, help=f"no_fly_zones prompts of the schema section (default: {bench.schema_prompts}; --quick: {quick.schema_prompts})")
    p.add_argument("--llama-cpp", action="store_true",
                   help='add llama.cpp on the base\'s GGUF as a peer (needs pip install -e ".[llama]")')
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="drone no-fly zones from air-traffic messages: Clover beside its peer, 3D map")
    p.add_argument("--messages", help=f"a file of your own messages, one a line (default: {GENERATED_MESSAGES} generated ones)")
    p.add_argument("--model", help=f"Clover model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--peer", help=f"the autoregressive peer's folder, or 'base': the converted model's base, not fine-tuned (default: models/{DEFAULT_PEER}, skipped if absent)")
    p.add_argument("--no-peer", action="store_true", help="Clover only")
    p.add_argument("--json", help="also write the zones, wall times, TPF and scores here")
    p.add_argument("--seed", type=int, default=0, help="which generated set of messages")
    p.add_argument("--out", default="outputs", help="folder for no_fly_zones.png and denoising.png (default: outputs)")
    p.add_argument("--block-size", type=_block_size,
                   help="tokens per block, or 'auto' (default: auto where the model is calibrated, else 16)")
    p.add_argument("--threshold", type=float, default=DecodeParams.threshold)
    _add_answers(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, JSON schemas, tools)")
    p.add_argument("--model", help=f"model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", help="the model id clients send (default: the folder's name)")
    p.add_argument("--max-prompt-tokens", type=int, default=ServerConfig.max_prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=ServerConfig.max_tokens, help="the largest max_tokens a request may ask for")
    p.add_argument("--max-batch-size", type=int, default=ServerConfig.max_batch_size)
    p.add_argument("--block-size", type=_block_size, default=ServerConfig.block_size,
                   help="the block size of requests that do not set one, or 'auto' (calibrated)")
    p.add_argument("--threshold", type=float, default=ServerConfig.threshold, help="the unmasking threshold of requests that do not set one")
    p.add_argument("--request-timeout", type=float, default=ServerConfig.request_timeout_s,
                   help="seconds after which a request ends with finish_reason time_limit")
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
