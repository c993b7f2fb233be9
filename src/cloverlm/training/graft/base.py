"""What the graft's training stages share (stage1.py, stage2.py): the teacher, the student, the trained mixers.

The teacher is the all-attention model the student was grafted from (convert/graft.py), frozen, in bf16
where the hardware multiplies it (checkpoint.multiplies_bf16, the rule that decoding and the conversion
trainer follow), else fp32. The student is the graft, in fp32, run under bf16 autocast by the same rule
(its weights and optimizer stay fp32, as the conversion trainer's adapter); what trains is the mixer (`linear_attn`) of
each memory layer that is attention in the teacher, with AdamW and no weight decay: the mixers start from the
attention's weights, and weight decay would pull them away. A checkpoint is the student as a plain Clover
folder (loadable by load_model) with the optimizer's state and the loop's; --resume continues from it, and the
teacher is loaded again from its folder. With --publish, each checkpoint also writes the student as a graft
folder (convert/graft_folder.py): the mixers in fp16 and the run's state and log, the form that ships. Given
as --student with --resume on a machine without the run's folder, the run continues from it: the same step,
schedule and batches, with Adam's moments started afresh and the rate warmed up again (a run's folder does
not outlive its machine here).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from pathlib import Path

import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from cloverlm.convert.graft import grafted_layers
from cloverlm.convert.graft_folder import graft_meta, is_graft_folder, recorded_runs, save_graft_folder
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import atomic_write_dir, multiplies_bf16, recover_dir, save_model
from cloverlm.model.layout import block_partition
from cloverlm.training.conversion.config import ConvertConfig
from cloverlm.training.conversion.data import ConversionData
from cloverlm.training.conversion.objective import CONVERT_BLOCK_SIZES
from cloverlm.training.conversion.trainer import device_label, resolve_device
from cloverlm.training.loop import Loop

STUDENT_DIR = "student"
# what a resumed run may change: where things are and how long to run, and eval_every, which nothing here
# reads (no held-out evaluation; runs before it was 0 recorded 10**9, the same nothing)
RESUME_MAY_CHANGE = ("teacher", "student", "out", "max_steps", "minutes", "device", "publish", "eval_every")


@dataclass
class GraftStageConfig:
    teacher: str = ""  # the all-attention model (plain Clover or adapter folder)
    student: str = ""  # its graft (clover convert --graft memory), or an earlier stage's student
    out: str = ""
    seed: int = 0
    mixture: dict[str, float] = field(default_factory=lambda: ConvertConfig().mixture)  # the conversion trainer's
    seq_len: int = 512  # positions per packed row (a multiple of 4, the smallest block size)
    rows_per_step: int = 2
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = None
    minutes: float | None = None
    # No held-out evaluation: every batch is new data, so each step's loss is measured before any update on it.
    eval_every: int = 0
    checkpoint_every: int | None = None  # steps; None: every checkpoint_minutes
    checkpoint_minutes: float = 10.0
    device: str = "cpu"
    bf16: bool | None = None  # the teacher's dtype and the student's autocast; None: where the hardware multiplies it
    # the grafted layers that train; None: all of them. A subset fits layers grafted after the others were
    # trained (e.g. the rest of an all-memory student) without spending steps on the trained ones again.
    layers: list[int] | None = None
    # a graft folder (convert/graft_folder.py) written with every checkpoint and at the end: the student as
    # it ships, which a later --resume on another machine continues from (e.g. models/smollm2-clover-hybrid)
    publish: str | None = None


def trained_layers(teacher, student, chosen: list[int] | None) -> list[int]:
    """The layers a stage trains: `chosen` (checked to be grafted layers), or every grafted layer."""
    grafted = grafted_layers(teacher, student)
    if chosen is None:
        return grafted
    if not chosen:
        raise CloverError("no layers to train: give at least one grafted layer (leave --layers out to train them all)")
    wrong = sorted(set(chosen) - set(grafted))
    if wrong:
        raise CloverError(f"layers {wrong} are not memory layers of the student in place of the teacher's attention "
                          f"(those are {','.join(map(str, grafted))})")  # fmt: skip
    return sorted(set(chosen))


def logged_by_step(log_path: Path, key: str) -> dict:
    """{step: record[key]} of train_log.jsonl's records that have `key`; a replayed step (after a crash and
    --resume) replaces the line the interrupted run wrote."""
    by_step = {}
    for line in log_path.read_text().splitlines() if log_path.is_file() else []:
        record = json.loads(line)
        if key in record:
            by_step[record["step"]] = record[key]
    return by_step


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start), by prefix sums."""
    sums = [0.0, *accumulate(values)]
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def plot_log(log_path: Path, png_path: Path, key: str, ylabel: str, title: str) -> None:
    """train_log.jsonl's `key` against the step, log scale: one line, or one a layer where the records hold
    {layer: value} (shallow to deep: dark to light). Each step's batch is new data, so one step's value is
    noisy: a line is the running mean over a window of 1% of the steps, and with 20 lines or more the raw
    values are left out."""
    by_step = logged_by_step(log_path, key)
    if not by_step:
        return
    steps = sorted(by_step)
    first = by_step[steps[0]]
    lines = sorted(first, key=int) if isinstance(first, dict) else [None]
    figure = Figure(figsize=(8, 5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    window = max(1, len(steps) // 100)
    for n, layer in enumerate(lines):
        values = [by_step[s] if layer is None else by_step[s][layer] for s in steps]
        colour = colormaps["viridis"](n / max(1, len(lines) - 1))
        if window > 1 and len(lines) < 20:
            axes.plot(steps, values, lw=0.5, color=colour, alpha=0.25)
        axes.plot(steps, running_mean(values, window), lw=1.0, color=colour, label=None if layer is None else f"layer {layer}")
    axes.set(yscale="log", xlabel="step", ylabel=f"{ylabel}, mean of {window} steps" if window > 1 else ylabel, title=title)
    if len(lines) > 1:
        axes.legend(fontsize=6, ncol=max(1, len(lines) // 12), loc="upper right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)


class GraftLoop(Loop):
    """A stage's loop: its config has teacher, student, out, device, bf16 (None: where the hardware multiplies
    it), seed, mixture, seq_len and rows_per_step. A stage adds its batch (from `rows` and `partition`), its
    loss and its curve (`plot`)."""

    log_steps_done = True
    plot_file = "loss.png"
    recipe = ""  # the stage's `clover train --recipe`, the key of its run in a published graft folder

    def __init__(self, cfg, resume: bool = False):
        if cfg.seq_len < 4 or cfg.seq_len % min(CONVERT_BLOCK_SIZES):
            raise CloverError(
                f"seq_len must be a positive multiple of {min(CONVERT_BLOCK_SIZES)}, got {cfg.seq_len}"
            )
        self.device = resolve_device(cfg.device)
        # the runs recorded in a graft folder student: carried into what this run publishes, and this stage's
        # own run continued by --resume where OUT holds no checkpoint (a run that began on another machine)
        self.published_runs = recorded_runs(cfg.student)
        published = self.published_runs.get(self.recipe)
        from_published = resume and published is not None and recover_dir(Path(cfg.out) / "checkpoint") is None
        super().__init__(cfg, resume and not from_published, tokens=0)
        if from_published:
            self._continue_published(published)
        saved = published if from_published else self.saved  # a continued run has no checkpoint of its own
        if saved is not None:
            stored, given = saved["config"], asdict(cfg)
            changed = sorted(k for k in given if k not in RESUME_MAY_CHANGE and stored.get(k) != given[k])
            if changed:
                raise CloverError(f"--resume with a different configuration than the checkpoint's: {', '.join(changed)} "
                                  f"(only {', '.join(RESUME_MAY_CHANGE)} may change)")  # fmt: skip
        # one switch: the teacher's dtype and the student's autocast (Loop.autocast), as the conversion trainer's
        self.bf16 = multiplies_bf16(self.device) if cfg.bf16 is None else cfg.bf16
        self.teacher = load_model(cfg.teacher, torch.bfloat16 if self.bf16 else torch.float32).to(
            self.device
        )
        self.teacher.requires_grad_(False)
        self.tokenizer = load_folder_tokenizer(cfg.teacher)
        # on resume the checkpoint is the student: its trained mixers, everything else as grafted
        self.student = (
            load_model(self.resumed or cfg.student, torch.float32).to(self.device).requires_grad_(False)
        )
        self.layers = trained_layers(self.teacher, self.student, cfg.layers)
        self.model = nn.ModuleDict({str(i): self.student.model.layers[i].linear_attn for i in self.layers})
        self.model.requires_grad_(True)
        self.start()
        self.data = ConversionData(self.tokenizer, ConvertConfig(seed=cfg.seed, mixture=cfg.mixture))
        self.block_sizes = [s for s in CONVERT_BLOCK_SIZES if s <= self.student.config.max_block_size]

    def rows(self, step: int, length: int) -> torch.Tensor:
        """[rows_per_step, length] chat-formatted examples of the mixture, one after another in each row, a pure
        function of (seed, step). A row's last example is cut: a row has no padding, which the mixers'
        bidirectional blocks would see."""
        rows = []
        for row in range(self.cfg.rows_per_step):
            rng = random.Random(f"{self.cfg.seed}/{step}/{row}")
            ids: list[int] = []
            while len(ids) < length:
                segment = self.data.sample(rng)
                ids += segment.prompt + segment.answer
            rows.append(ids[:length])
        return torch.tensor(rows)

    def partition(self, step: int) -> tuple[list[int], torch.Generator]:
        """The step's block partition of seq_len positions (sizes from the conversion trainer's, the sizes the
        model decodes and commits in), and the generator it was drawn from, for the step's other draws."""
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return block_partition(self.cfg.seq_len, self.block_sizes, generator, overhang=False), generator

    def param_groups(self) -> list[dict]:
        return [{"params": list(self.model.parameters()), "weight_decay": 0.0}]

    def plot(self, png_path: Path) -> None:
        """The stage's curve from train_log.jsonl (self.log_path)."""
        raise NotImplementedError

    def save_weights(self, folder: Path) -> None:
        save_model(self.student, self.tokenizer, folder)

    def save_checkpoint(self, final: bool = False) -> None:
        super().save_checkpoint(final)
        self.plot(self.out / self.plot_file)
        self.publish()

    @property
    def published_log(self) -> str:
        return f"{self.recipe}_log.jsonl"

    def _continue_published(self, published: dict) -> None:
        """Take up this stage's run where the published student left it: its step, schedule and tokens, and
        its log. The optimizer's moments start afresh: a graft folder keeps the weights only."""
        self.state = {**published["state"], "rewarm_from": published["state"]["step"]}
        if self.cfg.max_steps is not None:
            self.state["max_steps"] = self.cfg.max_steps
        log = Path(self.cfg.student) / self.published_log
        if log.is_file() and not self.log_path.exists():
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, self.log_path)
        self.log({"event": "continued from a graft folder", "student": self.cfg.student, "step": self.state["step"],
                  "optimizer": "fresh moments"})  # fmt: skip

    def lr_at(self, step: int) -> float:
        """The schedule's rate, warmed up again over warmup_steps after a run continued from a graft folder:
        Adam's fresh moments would otherwise take full-size steps at once."""
        scheduled = super().lr_at(step)
        if "rewarm_from" not in self.state:
            return scheduled
        return scheduled * min(1.0, (step - self.state["rewarm_from"] + 1) / self.cfg.warmup_steps)

    def publish(self) -> None:
        """The student as a graft folder at cfg.publish: this run's state, log and curve beside the earlier
        runs' records that the student folder carried."""
        if not self.cfg.publish:
            return
        runs = {**self.published_runs, self.recipe: {"state": self.state, "config": asdict(self.cfg),
                                                     "device": device_label(self.device)}}  # fmt: skip
        student = Path(self.cfg.student)
        carried = graft_meta(student).get("files", []) if is_graft_folder(student) else []
        files = {name: (student / name).read_bytes() for name in carried if (student / name).is_file()}
        for source, name in ((self.log_path, self.published_log), (self.out / self.plot_file, self.plot_file)):
            if source.is_file():
                files[name] = source.read_bytes()
        save_graft_folder(self.student, self.teacher, self.cfg.teacher, self.cfg.publish, runs, files)

    def finish(self, metrics: dict | None) -> dict:
        student = self.out / STUDENT_DIR
        atomic_write_dir(student, lambda folder: save_model(self.student, self.tokenizer, folder))
        self.plot(self.out / self.plot_file)
        return {"steps": self.state["step"], "tokens": self.state["tokens"], "layers": self.layers,
                "teacher": "bf16" if self.bf16 else "fp32", "device": device_label(self.device),
                "out": str(student), "plot": str(self.out / self.plot_file), "published": self.cfg.publish}  # fmt: skip
