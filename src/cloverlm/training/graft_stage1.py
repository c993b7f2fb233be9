"""Stage 1 of the memory graft (issue 30): every grafted memory layer trained, layer by layer, to do what the
attention layer it replaced did (`clover train --recipe graft-stage1`).

The student is a grafted folder (convert/graft.py: `clover convert --graft memory`), the teacher the
all-attention model it was grafted from. Each step runs the teacher once, without gradients, over packed rows
of the conversion trainer's task mixture, and keeps every grafted layer's attention input (the output of
`input_layernorm`) and output (the output of `o_proj`). Each grafted mixer then reads its own layer's teacher
input and is fitted to that layer's teacher output. This is the first stage of "Distilling to Hybrid Attention
Models via KL-Guided Layer Selection" (each layer's output aligned to its attention's, short sequences) and of
LoLCATs (the new parts trained to match the softmax outputs). It is layer-local: no gradient crosses the
stack, so the student's other layers never run. That makes it the cheapest training this CPU can do. Stage 2
(the whole hybrid on logit KL) then fixes the errors that the layers pile up on one another.

Choices:
- loss: per layer, mean_t |mixer(x)_t - y_t|^2 / mean_t |y_t|^2 (a normalised MSE: 1.0 for a silent layer,
  0 for an exact one), averaged over the layers. The layers' outputs differ in size by orders of magnitude
  along the stack. A plain MSE would let the loudest layers fill the shared gradient clip and the log.
  Normalised, every layer counts alike and the curves compare across layers and models. Adam does not see the
  scale of the mean over layers, only the clip does.
- block sizes: the clean stream runs on blocks drawn from the conversion trainer's sizes
  (CONVERT_BLOCK_SIZES, one partition per step), the sizes the model decodes and commits in. A memory layer
  sees its own block bidirectionally and the blocks before it through its state (memory layers ignore
  `causal_clean_stream`). With block size 1, the in-block attention and the fusion gate would learn nothing.
  The teacher runs causally (block size 1, as in `teacher_layers`; with causal_clean_stream the block sizes
  do not change its output).
- dtype: the teacher in bf16 where the hardware multiplies it (checkpoint.multiplies_bf16, the rule that
  decoding and the conversion trainer's autocast follow), else fp32. The trained mixers stay fp32, with AdamW
  and no weight decay: they start from the attention's weights, and weight decay would pull them away.
- a checkpoint is the student as a plain Clover folder (loadable by load_model) with the optimizer's state
  and the loop's state. --resume continues from it, and the teacher is loaded again from --teacher.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from cloverlm.convert.graft import check_graft_of, teacher_layers
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import atomic_write_dir, multiplies_bf16, save_model
from cloverlm.model.config import ATTENTION, MEMORY
from cloverlm.model.layout import BlockLayout, block_partition
from cloverlm.training.conversion.config import ConvertConfig
from cloverlm.training.conversion.data import ConversionData
from cloverlm.training.conversion.objective import CONVERT_BLOCK_SIZES
from cloverlm.training.conversion.trainer import device_label, resolve_device
from cloverlm.training.loop import Loop

PLOT_FILE = "stage1_loss.png"
STUDENT_DIR = "student"
RESUME_MAY_CHANGE = ("teacher", "student", "out", "max_steps", "minutes", "device")


@dataclass
class Stage1Config:
    teacher: str = ""  # the all-attention model (plain Clover or adapter folder)
    student: str = ""  # its graft (clover convert --graft memory)
    out: str = "runs/graft-stage1"
    seed: int = 0
    mixture: dict[str, float] = field(default_factory=lambda: ConvertConfig().mixture)  # the conversion trainer's
    seq_len: int = 512  # tokens per packed row (a multiple of 4, the smallest block size)
    rows_per_step: int = 2
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = None
    minutes: float | None = None
    # No held-out evaluation: every batch is new data, so each step's loss is measured before any update on it.
    eval_every: int = 10**9
    checkpoint_every: int | None = None  # steps; None: every checkpoint_minutes
    checkpoint_minutes: float = 10.0
    device: str = "cpu"
    bf16: bool | None = None  # the teacher's dtype; None: bf16 where the hardware multiplies it


def grafted_layers(teacher, student) -> list[int]:
    """The student's memory layers that are attention layers in the teacher: the layers stage 1 trains."""
    check_graft_of(teacher, student)
    t, s = teacher.config, student.config
    layers = [i for i, (a, b) in enumerate(zip(t.layer_types, s.layer_types)) if a == ATTENTION and b == MEMORY]
    if not layers:
        raise CloverError("the student has no memory layer in place of a teacher's attention layer: nothing to train")
    return layers


def plot_layer_losses(log_path: Path, png_path: Path) -> None:
    """Each layer's loss against the step (one line a layer, log scale) from train_log.jsonl; a replayed step
    (after a crash and --resume) replaces the line the interrupted run wrote."""
    by_step = {}
    for line in log_path.read_text().splitlines() if log_path.is_file() else []:
        record = json.loads(line)
        if "layer_loss" in record:
            by_step[record["step"]] = record["layer_loss"]
    if not by_step:
        return
    steps = sorted(by_step)
    layers = sorted(by_step[steps[0]], key=int)
    figure = Figure(figsize=(8, 5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for n, layer in enumerate(layers):  # shallow to deep: dark to light
        colour = colormaps["viridis"](n / max(1, len(layers) - 1))
        axes.plot(steps, [by_step[s][layer] for s in steps], lw=0.8, color=colour, label=f"layer {layer}")
    axes.set(yscale="log", xlabel="step", ylabel="|mixer - attention|² / |attention|²",
             title="Graft stage 1: each memory layer against its attention")  # fmt: skip
    axes.legend(fontsize=6, ncol=max(1, len(layers) // 12), loc="upper right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)


class GraftStage1(Loop):
    label = "graft stage 1"
    log_steps_done = True

    def __init__(self, cfg: Stage1Config, resume: bool = False):
        if cfg.seq_len < 4 or cfg.seq_len % min(CONVERT_BLOCK_SIZES):
            raise CloverError(f"seq_len must be a positive multiple of {min(CONVERT_BLOCK_SIZES)}, got {cfg.seq_len}")
        self.device = resolve_device(cfg.device)
        super().__init__(cfg, resume, tokens=0)
        if self.saved is not None:
            stored, given = self.saved["config"], asdict(cfg)
            changed = sorted(k for k in given if k not in RESUME_MAY_CHANGE and stored.get(k) != given[k])
            if changed:
                raise CloverError(f"--resume with a different configuration than the checkpoint's: {', '.join(changed)} "
                                  f"(only {', '.join(RESUME_MAY_CHANGE)} may change)")  # fmt: skip
        bf16 = multiplies_bf16(self.device) if cfg.bf16 is None else cfg.bf16
        self.teacher = load_model(cfg.teacher, torch.bfloat16 if bf16 else torch.float32).to(self.device)
        self.teacher.requires_grad_(False)
        self.tokenizer = load_folder_tokenizer(cfg.teacher)
        # on resume the checkpoint is the student: its trained mixers, everything else as grafted
        self.student = load_model(self.resumed or cfg.student, torch.float32).to(self.device).requires_grad_(False)
        self.layers = grafted_layers(self.teacher, self.student)
        self.model = nn.ModuleDict({str(i): self.student.model.layers[i].linear_attn for i in self.layers})
        self.model.requires_grad_(True)
        self.teacher_dtype = "bf16" if bf16 else "fp32"
        self.start()
        self.data = ConversionData(self.tokenizer, ConvertConfig(seed=cfg.seed, mixture=cfg.mixture))
        max_block = self.student.config.max_block_size
        self.block_sizes = [s for s in CONVERT_BLOCK_SIZES if s <= max_block]

    def param_groups(self) -> list[dict]:
        return [{"params": list(self.model.parameters()), "weight_decay": 0.0}]

    def row(self, step: int, row: int) -> list[int]:
        """seq_len tokens of chat-formatted examples of the mixture, one after another. The last example is
        cut: a row has no padding, which the mixers' bidirectional blocks would see."""
        rng = random.Random(f"{self.cfg.seed}/{step}/{row}")
        ids: list[int] = []
        while len(ids) < self.cfg.seq_len:
            segment = self.data.sample(rng)
            ids += segment.prompt + segment.answer
        return ids[: self.cfg.seq_len]

    def batch(self, step: int):
        """(ids [rows, seq_len], the step's block partition): a pure function of (seed, step)."""
        ids = torch.tensor([self.row(step, r) for r in range(self.cfg.rows_per_step)])
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return ids, block_partition(self.cfg.seq_len, self.block_sizes, generator, overhang=False)

    def micro_batches(self, batch) -> list:
        """The one teacher forward of the step, then one part per grafted layer: (layer, its teacher input,
        its teacher output, layout, positions). Each layer goes forward and backward on its own, so that only
        one layer's activations are alive at a time."""
        ids, partition = batch
        captured = teacher_layers(self.teacher, self.layers, ids)
        layout = BlockLayout.build(partition, self.student.config.max_block_size, self.device)
        positions = torch.arange(ids.shape[1], device=self.device)
        return [(i, x.float(), y.float(), layout, positions) for i, (x, y) in captured.items()]

    def loss(self, part, step: int):
        layer, x, y, layout, positions = part
        out = self.model[str(layer)].forward_streams(None, x, layout, positions)[1]
        error = (out.float() - y).pow(2).sum(-1).mean() / y.pow(2).sum(-1).mean()
        return error / len(self.layers), {str(layer): float(error.detach())}

    def merge(self, outs: list[dict]) -> dict:
        return {layer: value for out in outs for layer, value in out.items()}

    def after_step(self, batch, total, layer_loss) -> dict:
        tokens = batch[0].numel()
        self.state["tokens"] += tokens
        rounded = {layer: round(value, 5) for layer, value in layer_loss.items()}
        return {"loss": float(total), "layer_loss": rounded, "tokens": tokens}

    def postfix(self, record: dict) -> dict:
        return {"loss": f"{record['loss']:.4f}"}

    def save_weights(self, folder: Path) -> None:
        save_model(self.student, self.tokenizer, folder)

    def save_checkpoint(self, final: bool = False) -> None:
        super().save_checkpoint(final)
        plot_layer_losses(self.log_path, self.out / PLOT_FILE)

    def finish(self, metrics: dict | None) -> dict:
        student = self.out / STUDENT_DIR
        atomic_write_dir(student, lambda folder: save_model(self.student, self.tokenizer, folder))
        plot_layer_losses(self.log_path, self.out / PLOT_FILE)
        return {"steps": self.state["step"], "tokens": self.state["tokens"], "layers": self.layers,
                "teacher": self.teacher_dtype, "device": device_label(self.device), "out": str(student),
                "plot": str(self.out / PLOT_FILE)}  # fmt: skip
