"""The memory graft's GPU window (issue 30), run by device.sh with WHAT=graft, without `cloverlm.cli` (the GPU
machine lacks the server's packages). Order of use: device.sh (there) runs `train`, then `mixers`;
collect_graft.sh (here) runs `rebuild`.

  run_graft.py train --teacher T --out OUT --minutes M [--stage1-share 0.4] [--keep 8] [--rows-per-step R] [--seq-len L]
      the CPU pipeline's steps (scripts/graft.sh all), in one window: OUT/all-memory, every attention layer of
      the teacher grafted (convert/graft.py; or --memory-layers); OUT/stage1, stage 1 on it for its share of
      the minutes; OUT/select, the --keep layers that go back to attention (select.py) and that hybrid;
      OUT/stage2, stage 2 on the hybrid for the rest. Each schedule spans --stage1-tokens / --stage2-tokens, so
      a window shorter than that stops part way, with the run's checkpoint and log as they are.
  run_graft.py mixers STUDENT TEACHER OUT_FILE
      the trained part of a student, every tensor under a grafted layer's mixer (base.GraftLoop trains only
      those), fp32, the layers, the graft's config and the teacher's digest in the metadata: 30M parameters where the whole student
      is 611 MB, so it comes back through the window (split.py cuts it).
  run_graft.py rebuild TEACHER MIXERS_FILE OUT
      here: the teacher grafted again with the mixers' layers, the mixers put in (keys and shapes checked,
      every mixer tensor replaced), saved as a Clover folder that `clover train --recipe graft-stage2
      --student OUT`, `clover graft-select` and `clover bench --hybrid OUT` read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cloverlm.convert.graft import attention_layers, graft_with_calibration
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.model.checkpoint import WEIGHTS, save_model
from cloverlm.training.graft.base import STUDENT_DIR
from cloverlm.training.graft.select import HYBRID_DIR, SelectConfig, select_layers
from cloverlm.training.graft.stage1 import GraftStage1, Stage1Config
from cloverlm.training.graft.stage2 import GraftStage2, Stage2Config

MIXER = ".linear_attn."  # the grafted layers' mixers: model.layers.{i}.linear_attn.*
# What a teacher's model is made of: a whole model's weights, or a LoRA adapter's over the pip base. Not the
# block-size head (calibration.safetensors), which the window's payload leaves out and a promotion refits.
TEACHER_WEIGHTS = (WEIGHTS, "adapter_model.safetensors")


def teacher_digest(teacher: str | Path) -> str:
    """The teacher's weights, by content: mixers are put back only into a graft of the teacher they learnt from."""
    digest = hashlib.sha256()
    paths = [Path(teacher) / name for name in TEACHER_WEIGHTS if (Path(teacher) / name).is_file()]
    if not paths:
        raise SystemExit(f"{teacher}: no {' or '.join(TEACHER_WEIGHTS)}: not a model folder")
    for path in paths:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def graft(teacher: str, memory_layers: list[int] | None):
    """(the teacher grafted with calibration, its tokenizer): the same graft in the window and here;
    memory_layers None: every attention layer (the all-memory student of stage 1, as `--memory-layers all`)."""
    tokenizer, model = load_folder_tokenizer(teacher), load_model(teacher)
    if memory_layers is None:
        memory_layers = attention_layers(model.config)
    return graft_with_calibration(model, tokenizer, memory_layers)[0], tokenizer


STAGES = {"stage1": (GraftStage1, Stage1Config), "stage2": (GraftStage2, Stage2Config)}


def train(args, probes: dict | None = None) -> dict:
    """The window's steps in turn, each resumed where an earlier call left it or skipped when done; probes:
    SelectConfig fields other than its defaults (the tests' tiny probes)."""
    out = Path(args.out)
    all_memory, stage1, selection = out / "all-memory", out / "stage1" / STUDENT_DIR, out / "select"
    started, summary = time.monotonic(), {}  # grafting counts against the minutes: the window's deadline is fixed

    def left() -> float:
        return args.minutes - (time.monotonic() - started) / 60

    if not (all_memory / "model.safetensors").is_file():
        save_model(*graft(args.teacher, args.memory_layers), all_memory)
    run_stage(args, "stage1", all_memory, min(args.minutes * args.stage1_share, left()), summary)
    hybrid = selection / HYBRID_DIR
    if (stage1 / "model.safetensors").is_file() and not (hybrid / "model.safetensors").is_file() and left() >= 0.2:
        cfg = SelectConfig(teacher=args.teacher, student=str(stage1), out=str(selection), keep=args.keep,
                           device=args.device, save_hybrid=True, **(probes or {}))  # fmt: skip
        report = select_layers(cfg, progress=False)
        summary["select"] = {key: report[key] for key in ("chosen", "baseline", "selected", "seconds")}
        print(json.dumps({"select": summary["select"]}), flush=True)
    run_stage(args, "stage2", hybrid, left(), summary)
    return summary


def run_stage(args, name: str, student: Path, minutes: float, summary: dict) -> None:
    """Stage `name` on `student` for `minutes` (none under 0.2 or without a student), resumed from its checkpoint."""
    if minutes < 0.2 or not (student / "model.safetensors").is_file():
        return
    stage, config = STAGES[name]
    # stage 2 counts a clean and a noisy stream per position: twice stage 1's tokens for one row
    per_step = args.rows_per_step * args.seq_len * (2 if name == "stage2" else 1)
    tokens = args.stage2_tokens if name == "stage2" else args.stage1_tokens
    extra = {"data_weight": args.stage2_data_weight} if name == "stage2" else {}
    out = Path(args.out) / name
    cfg = config(teacher=args.teacher, student=str(student), out=str(out), max_steps=max(1, tokens // per_step),
                 minutes=minutes, checkpoint_minutes=2.0, rows_per_step=args.rows_per_step, seq_len=args.seq_len,
                 device=args.device, **extra)  # fmt: skip
    summary[name] = stage(cfg, resume=(out / "checkpoint").is_dir()).run()
    print(json.dumps({name: summary[name]}), flush=True)


def mixers(student: Path, teacher: str, out_file: Path) -> dict:
    config = json.loads((student / "config.json").read_text())
    with safe_open(str(student / "model.safetensors"), "pt") as handle:
        tensors = {key: handle.get_tensor(key).float() for key in handle.keys() if MIXER in key}
    layers = sorted({int(key.split(".")[2]) for key in tensors})
    meta = {"layers": json.dumps(layers), "config": json.dumps(config), "student": str(student),
            "teacher_sha256": teacher_digest(teacher)}
    save_file(tensors, str(out_file), metadata=meta)
    return {"tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values()), "layers": layers}


def rebuild(teacher: str, mixers_file: Path, out: Path) -> dict:
    with safe_open(str(mixers_file), "pt") as handle:
        meta = handle.metadata()
    layers = json.loads(meta["layers"])
    if meta.get("teacher_sha256") != teacher_digest(teacher):
        raise SystemExit(f"{teacher} is not the teacher these mixers learnt from (its weights differ): "
                         "graft the teacher of the window (the adapter staged then)")
    trained = load_file(str(mixers_file))
    model, tokenizer = graft(teacher, layers)
    state = model.state_dict()
    own = {key for key in state if MIXER in key}
    if own != set(trained):
        raise SystemExit(f"the mixers do not fit this graft: missing {sorted(own - set(trained))[:3]}, "
                         f"unexpected {sorted(set(trained) - own)[:3]}")  # fmt: skip
    wrong = [key for key in own if state[key].shape != trained[key].shape]
    if wrong:
        raise SystemExit(f"shapes differ for {wrong[:3]}")
    model.load_state_dict({key: trained[key].to(state[key].dtype) for key in own}, strict=False)
    save_model(model, tokenizer, out)
    return {"out": str(out), "layers": layers, "tensors": len(own)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("train")
    p.add_argument("--teacher", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--stage1-share", type=float, default=0.4, help="of the minutes; stage 2 gets the rest")
    p.add_argument("--stage1-tokens", type=int, default=5_000_000, help="stage 1's schedule (issue 30: >= 5M)")
    p.add_argument("--stage2-tokens", type=int, default=50_000_000)
    p.add_argument("--stage2-data-weight", type=float, default=0.0, help="the text's cross-entropy beside stage 2's KL")
    p.add_argument("--rows-per-step", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int)
    p.add_argument("--memory-layers", type=lambda text: [int(i) for i in text.split(",")],
                   help="the layers grafted for stage 1 (default: every attention layer)")
    p.add_argument("--keep", type=int, default=SelectConfig.keep, help="layers the selection turns back into attention")
    p = commands.add_parser("mixers")
    p.add_argument("student", type=Path)
    p.add_argument("teacher")
    p.add_argument("out_file", type=Path)
    p = commands.add_parser("rebuild")
    p.add_argument("teacher")
    p.add_argument("mixers_file", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "train":
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(train(args)))
    elif args.command == "mixers":
        print(json.dumps(mixers(args.student, args.teacher, args.out_file)))
    else:
        print(json.dumps(rebuild(args.teacher, args.mixers_file, args.out)))


if __name__ == "__main__":
    main()
