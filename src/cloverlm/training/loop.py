"""The training loop every objective shares: from scratch (scratch/train.py) and the LoRA conversion, its
autoregressive peer and distillation (conversion/trainer.py).

An objective is a subclass of Loop. It builds its model, then calls `start()`, and supplies what differs
between runs: its parameters (`param_groups`), its data (`batch(step)`, a pure function of seed and step),
its loss (`loss`, then `after_step` for what happens outside the gradient), its held-out scores
(`evaluate`), how it writes weights (`save_weights`: a model folder or a LoRA adapter) and its final
write and summary (`finish`). The loop owns the rest, once: the warm-up + cosine schedule, AdamW with
gradient clipping, train_log.jsonl, the progress bar, periodic evaluation, checkpoints, `--resume` and
`--minutes`.

A checkpoint folder holds the objective's weights, optimizer.safetensors and train_state.json (the loop's
state, the optimizer's non-tensor state and the run's config); under torchrun the model and optimizer
tensors are DCP shards instead (distributed.py). No pickles. Since every batch and mask is a function of
(seed, step) and the checkpoint holds everything else, `--resume` replays exactly the steps an
uninterrupted run takes.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import (
    atomic_write_dir,
    load_optimizer_file,
    load_optimizer_state,
    optimizer_tensors,
    recover_dir,
)
from cloverlm.training import distributed

STATE_FILE = "train_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
LOG_FILE = "train_log.jsonl"
CALIBRATION_STEPS = 3
CALIBRATION_SHARE = 0.92  # of --minutes: evaluation and checkpoints take about 8% of the time


def resident_gib() -> tuple[float, float]:
    """(resident memory now, its peak so far) of this process, in GiB (Linux; zeros elsewhere)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except OSError:
        return 0.0, 0.0
    now = pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    return round(now, 2), round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
    except OSError:
        return None


LIBC = _libc()


def release_heap() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim), after every step. glibc moves
    its mmap threshold up to the largest block freed so far (up to 32 MiB), after which activations of a
    few MiB come from the heap, where one block still in use keeps the freed ones around it resident
    (tests/test_heap.py): a CPU training run's memory climbed step after step until the OOM killer ended
    it (models/README.md). Trimming between steps keeps the heap's reuse inside a step and bounds what
    stays resident to one step's peak. True where it ran (glibc)."""
    return bool(LIBC is not None and LIBC.malloc_trim(0) >= 0)


def lr_at(step: int, cfg, max_steps: int) -> float:
    """Linear warm-up over cfg.warmup_steps, then a cosine from cfg.lr down to cfg.min_lr_ratio * cfg.lr
    at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _rounded(fields: dict) -> dict:
    """Log precision: the loss to 5 decimals (the distributed tests compare it), other floats to 4, the
    learning rate whole."""
    return {
        k: round(v, 5 if k == "loss" else 4) if isinstance(v, float) and k != "lr" else v for k, v in fields.items()
    }


class Loop:
    """The loop over one objective's steps. The config (TrainConfig, ConvertConfig) gives out, lr,
    warmup_steps, min_lr_ratio, grad_clip, max_steps, minutes, eval_every (steps, and the schedule's last; 0:
    no evaluation, for runs whose held-out pass would cost more than their steps) and checkpoint_every (steps;
    when None, checkpoint_minutes)."""

    label = "train"  # the progress bar's
    betas = (0.9, 0.999)
    # The log's "step": the step's index (from scratch) or the steps done after it (conversion): each is
    # what that trainer's logs have always said, and the shipped logs in models/ are read that way.
    log_steps_done = False
    # Held-out scores as a log line of their own ({"event": "eval"}), or inside the step's record.
    eval_as_event = True
    device = torch.device("cpu")
    bf16 = False  # autocast

    def __init__(self, cfg, resume: bool, **fresh_state):
        """Finds the run's checkpoint: `self.resumed` (the folder, or None) and `self.saved` (its
        train_state.json). The objective's own state fields start at `fresh_state`."""
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.checkpoint = self.out / "checkpoint"
        self.log_path = self.out / LOG_FILE
        self.resumed = recover_dir(self.checkpoint)
        if resume and self.resumed is None:
            raise CloverError(f"--resume: no checkpoint in {self.out}")
        if not resume and self.resumed is not None:
            raise CloverError(f"{self.out} already holds a run; pass --resume to continue it or choose another --out")
        self.saved = json.loads((self.resumed / STATE_FILE).read_text()) if self.resumed else None
        self.state = self.saved["state"] if self.saved else {"step": 0, "max_steps": cfg.max_steps, **fresh_state}
        if cfg.max_steps is not None:  # a resumed run may be given more (or fewer) steps
            self.state["max_steps"] = cfg.max_steps
        self._host: ThreadPoolExecutor | None = None
        self._prefetched: dict[int, Future] = {}

    # ------------------------------------------------------------------------------------------
    # What an objective supplies

    model: torch.nn.Module  # what is trained and checkpointed (unwrapped: no DDP, FSDP or compile)

    def param_groups(self) -> list[dict]:
        raise NotImplementedError

    def batch(self, step: int):
        """The batch of `step`; runs on a host thread while the previous step trains."""
        raise NotImplementedError

    def loss(self, batch, step: int) -> tuple[torch.Tensor, object]:
        """(what is backpropagated, anything after_step needs)."""
        raise NotImplementedError

    def micro_batches(self, batch) -> list:
        """The parts of a batch that go forward and backward one after another (default: the whole)."""
        return [batch]

    def merge(self, outs: list):
        """One `loss` output from the parts' (micro_batches)."""
        raise NotImplementedError

    def after_step(self, batch, total: torch.Tensor, out) -> dict:
        """Bookkeeping after the optimizer step; the step's log fields, "loss" among them."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        return {}

    def lr_at(self, step: int) -> float:
        """The learning rate of `step` (default: the schedule, `lr_at`)."""
        return lr_at(step, self.cfg, self.state["max_steps"])

    def advance(self, steps_done: int, metrics: dict | None) -> list[dict]:
        """Decisions after a step (and its evaluation, if any); the events to log."""
        return []

    def save_weights(self, folder: Path) -> None:
        raise NotImplementedError

    def save_sharded_main(self, folder: Path, full_state: dict | None) -> None:
        """Rank 0's part of a sharded checkpoint, all except the shards (full_state: the final weights)."""
        raise CloverError(f"{type(self).__name__} does not train under torchrun")

    def forget_calibration(self) -> None:
        """Undo what the calibration steps changed outside the weights, optimizer and state."""

    def postfix(self, record: dict) -> dict:
        return {"loss": f"{record['loss']:.3f}"}

    def finish(self, metrics: dict | None) -> dict:
        """The final write after the last checkpoint; the run's summary."""
        return {"steps": self.state["step"]}

    # ------------------------------------------------------------------------------------------
    # The loop

    def start(self) -> None:
        """The optimizer, once the model is built; on resume its saved state (and, from a sharded
        checkpoint, the model's)."""
        self.optimizer = torch.optim.AdamW(self.param_groups(), lr=self.cfg.lr, betas=self.betas)
        if self.saved is None:
            return
        if self.saved.get("format") == "dcp":
            groups = self.saved["optimizer"]["param_groups"]
            distributed.load_sharded(self.resumed, self.model, self.optimizer, groups)
        else:
            tensors = load_optimizer_file(self.resumed / OPTIMIZER_FILE)
            load_optimizer_state(self.optimizer, tensors, self.saved["optimizer"])

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def log(self, record: dict) -> None:
        if not distributed.is_main():
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _batch_of(self, step: int):
        pending = self._prefetched.pop(step, None)
        batch = pending.result() if pending is not None else self.batch(step)
        if self._host is not None and step + 1 < self.state["max_steps"]:
            self._prefetched[step + 1] = self._host.submit(self.batch, step + 1)
        return batch

    def train_step(self, step: int, batch=None) -> dict:
        """One optimizer step on the batch of `step` (built here unless given); the step's log record."""
        batch = self._batch_of(step) if batch is None else batch
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total, outs = 0.0, []
        for part in self.micro_batches(batch):  # gradients accumulate; the parts' losses add up to the batch's
            with self.autocast():
                loss, out = self.loss(part, step)
            loss.backward()
            total, outs = total + loss.detach(), outs + [out]
        out = outs[0] if len(outs) == 1 else self.merge(outs)
        grad_norm = distributed.clip_grad_norm(self.model, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        fields = self.after_step(batch, total, out)
        del batch, total, out, outs
        release_heap()
        return {"step": step + int(self.log_steps_done), "lr": lr, "grad_norm": grad_norm, **fields}

    def calibrate(self) -> int:
        """A --minutes budget as a fixed step count, so that the schedule and resume stay step-based: a
        few timed steps, then undone."""
        snapshot = {k: v.clone() for k, v in self.model.state_dict().items()}
        state = json.loads(json.dumps(self.state))
        self.state["max_steps"] = 10**9
        start = time.perf_counter()
        for step in range(CALIBRATION_STEPS):
            self.train_step(step)
        per_step = (time.perf_counter() - start) / CALIBRATION_STEPS
        self.model.load_state_dict(snapshot)
        self.optimizer.state.clear()  # fresh Adam moments: the probe steps never happened
        self.state = state
        self.forget_calibration()
        return max(1, int(self.cfg.minutes * 60 * CALIBRATION_SHARE / per_step))

    def save_checkpoint(self, final: bool = False) -> None:
        """The checkpoint folder, swapped in atomically; `final` also gathers full weights under torchrun."""
        if distributed.active():

            def write_main(folder: Path, param_groups: list, full_state: dict | None) -> None:
                self.save_sharded_main(folder, full_state)
                world = distributed.world_size()
                self._write_state(folder, {"param_groups": param_groups}, format="dcp", world_size=world)

            distributed.save_sharded(self.checkpoint, self.model, self.optimizer, write_main, full=final)
            return
        tensors, meta = optimizer_tensors(self.optimizer)

        def write(folder: Path) -> None:
            self.save_weights(folder)
            save_file(tensors, str(folder / OPTIMIZER_FILE))
            self._write_state(folder, meta)

        atomic_write_dir(self.checkpoint, write)

    def _write_state(self, folder: Path, optimizer_meta: dict, **extra) -> None:
        payload = {"state": self.state, "optimizer": optimizer_meta, "config": asdict(self.cfg), **extra}
        (folder / STATE_FILE).write_text(json.dumps(payload, indent=1))

    def _checkpoint_due(self, steps_done: int, last_save: float) -> bool:
        if self.cfg.checkpoint_every:
            return steps_done % self.cfg.checkpoint_every == 0
        # rank 0's clock decides for all: ranks that disagree on a collective save deadlock
        return bool(distributed.from_main(time.monotonic() - last_save > self.cfg.checkpoint_minutes * 60))

    def run(self, stop_at: int | None = None) -> dict:
        """Train to max_steps, or to `stop_at` steps (the schedule still spans max_steps: a run continued in
        parts), or until --minutes run out; then the final checkpoint and `finish`."""
        cfg = self.cfg
        started = time.time()
        if self.state["max_steps"] is None:
            if cfg.minutes is None:
                raise CloverError("give --max-steps or --minutes")
            self.state["max_steps"] = int(distributed.from_main(self.calibrate()))  # timings differ by rank
            self.log({"event": "calibrated", "max_steps": self.state["max_steps"], "minutes": cfg.minutes})
        # --minutes beside a step count is a wall-clock limit; without one it was the step count
        deadline = started + 60 * cfg.minutes if cfg.minutes is not None and cfg.max_steps is not None else None
        max_steps, start_step = self.state["max_steps"], self.state["step"]
        end_step = max_steps if stop_at is None else min(stop_at, max_steps)
        self.model.train()
        bar = tqdm(
            total=max_steps, initial=start_step, desc=self.label, dynamic_ncols=True, disable=not distributed.is_main()
        )
        metrics, saved, tokens, last_save = None, False, 0, time.monotonic()
        timer = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=1) as self._host:
                for step in range(start_step, end_step):
                    if deadline is not None and time.time() > deadline:
                        break
                    record = self.train_step(step)
                    done = self.state["step"] = step + 1
                    tokens += record.get("tokens", 0)
                    elapsed = time.perf_counter() - timer
                    rss, peak = resident_gib()
                    record |= {"tok_s": round(tokens / elapsed, 1), "elapsed_s": round(elapsed, 1), "rss_gib": rss,
                               "peak_rss_gib": peak}  # fmt: skip
                    last = done == end_step
                    metrics = None
                    # at the schedule's end, not at a stop_at before it: a run in pieces logs what one call logs
                    if cfg.eval_every and (done % cfg.eval_every == 0 or done == max_steps):
                        metrics = self.evaluate()  # on every rank: FSDP's forward is collective
                        if distributed.is_main():
                            bar.write(f"step {done}: " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
                    if metrics and not self.eval_as_event:
                        record |= metrics
                    self.log(_rounded(record))
                    if metrics and self.eval_as_event:
                        self.log({"event": "eval", "step": done, **_rounded(metrics)})
                    for event in self.advance(done, metrics):
                        self.log(event)
                    bar.update(1)
                    bar.set_postfix(self.postfix(record))
                    saved = self._checkpoint_due(done, last_save) or last
                    if saved:
                        self.save_checkpoint(final=last)
                        last_save = time.monotonic()
        finally:
            self._host, self._prefetched = None, {}
            bar.close()
        if not (saved and self.state["step"] == end_step):  # stopped by --minutes, or nothing left to do
            self.save_checkpoint(final=True)
        return self.finish(metrics)
