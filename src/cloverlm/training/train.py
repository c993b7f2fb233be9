"""Block-diffusion training: the loop, checkpoints and exact resume.

Run: `clover train --preset clover-tiny --recipe default --minutes 60 --out runs/tiny`.
Every batch and every mask is a pure function of (seed, step), and checkpoints hold the weights,
optimizer and schedule state, so `--resume` replays exactly the steps an uninterrupted run takes.
The recipe and settings are recipe.py, the held-out scores probes.py; `--arch qwen3.5-moe` trains
the same-size autoregressive peer on the same data and schedule (archs.py).
Under torchrun the same loop runs data-parallel (distributed.py): same global batch, same losses.
"""

from __future__ import annotations

import json
import time
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
from cloverlm.model.config import CHUNK_SIZE, preset_config
from cloverlm.tokenizer import load_tokenizer
from cloverlm.training import distributed
from cloverlm.training.archs import ARCHS
from cloverlm.training.data import Batch, Mixture, build_default_tokenizer, tokenize_stdlib
from cloverlm.training.probes import Evaluator
from cloverlm.training.recipe import RECIPES, TrainConfig, lr_at


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.recipe = RECIPES.get(cfg.recipe)
        if self.recipe is None:
            raise CloverError(f"unknown recipe '{cfg.recipe}'; choose from: {', '.join(RECIPES)}")
        self.arch = ARCHS.get(cfg.arch)
        if self.arch is None:
            raise CloverError(f"unknown arch '{cfg.arch}'; choose from: {', '.join(ARCHS)}")
        if cfg.seq_len % CHUNK_SIZE:
            raise CloverError(f"seq_len={cfg.seq_len} must be a multiple of {CHUNK_SIZE} (the chunk size)")
        self.device = distributed.init()
        self.rows = distributed.shard_rows(cfg.batch_size)
        self.state = {"step": 0, "stage": 0, "stage_starts": [0], "max_steps": cfg.max_steps, "tokens_seen": 0}
        checkpoint = recover_dir(self.out / "checkpoint")
        if resume and checkpoint is None:
            raise CloverError(f"--resume: no checkpoint in {self.out}")
        if not resume and checkpoint is not None:
            raise CloverError(f"{self.out} already holds a run; pass --resume to continue it or choose another --out")
        if checkpoint is not None:
            saved = json.loads((checkpoint / "train_state.json").read_text())
            saved_arch = saved["train_config"].get("arch", "clover")
            if saved_arch != cfg.arch:
                raise CloverError(f"{self.out} is a run of --arch {saved_arch}; resume it with the same --arch")
            self.state = saved["state"]
            self.tokenizer = load_tokenizer(checkpoint)
            sharded = saved.get("format") == "dcp"
            if not sharded and distributed.active() and distributed.strategy() == "fsdp":
                raise CloverError(f"{checkpoint} was saved by one process; resume it without torchrun or with CLOVER_PARALLEL=ddp")
            self.model = (self.arch.blank(checkpoint) if sharded else self.arch.load(checkpoint)).train()
        elif cfg.init_from:  # fine-tune: the weights and tokenizer of a model folder, a fresh schedule
            self.tokenizer = load_tokenizer(cfg.init_from)
            self.model = self.arch.load(cfg.init_from).train()
        else:
            self.tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else self._default_tokenizer()
            config = preset_config(
                cfg.preset,
                vocab_size=len(self.tokenizer),
                mask_token_id=self.tokenizer.mask_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                **cfg.overrides,
            )
            torch.manual_seed(cfg.seed)
            self.model = self.arch.build(config).train()
        self.model.to(self.device)
        # the training forward; evaluation, the optimizer and checkpoints use self.model itself
        self.train_model = distributed.wrap(self.model) if distributed.active() else self.model
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (decay if param.ndim >= 2 and "embed" not in name else no_decay).append(param)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
        if checkpoint is not None and sharded:
            distributed.load_sharded(checkpoint, self.model, self.optimizer, saved["optimizer"]["param_groups"])
        elif checkpoint is not None:
            load_optimizer_state(
                self.optimizer,
                load_optimizer_file(checkpoint / "optimizer.safetensors"),
                saved["optimizer"],
            )
        stdlib = tokenize_stdlib(self.tokenizer, "train") if self.recipe.mixture.get("stdlib") else None
        self.mixture = Mixture(self.tokenizer, self.recipe.mixture, cfg.seq_len, stdlib, self.recipe.task_sizes)
        # a spread of 1 in 10 test files is plenty for four evaluation windows
        self.evaluator = Evaluator(self.tokenizer, cfg, tokenize_stdlib(self.tokenizer, "val", every=10), self.arch.metrics)
        self.log_path = self.out / "train_log.jsonl"

    def _default_tokenizer(self):
        if not distributed.active():
            return build_default_tokenizer()
        # BPE training is not promised to be deterministic: rank 0 trains it, the others read its files
        folder = self.out / "tokenizer"
        if distributed.is_main():
            build_default_tokenizer().save_pretrained(folder)
        distributed.barrier()
        return load_tokenizer(folder)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def _log(self, record: dict) -> None:
        if not distributed.is_main():
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def save_checkpoint(self, final: bool = False) -> None:
        if distributed.active():
            self._save_sharded(final)
            return
        tensors, meta = optimizer_tensors(self.optimizer)

        def write(folder: Path):
            self.arch.save(self.model, self.tokenizer, folder)
            save_file(tensors, str(folder / "optimizer.safetensors"))
            self._write_train_state(folder, meta)

        atomic_write_dir(self.out / "checkpoint", write)

    def _write_train_state(self, folder: Path, optimizer_meta: dict, **extra) -> None:
        """train_state.json: the schedule, the optimizer's non-tensor state and the run's config."""
        payload = {"state": self.state, "optimizer": optimizer_meta, "train_config": asdict(self.cfg), **extra}
        (folder / "train_state.json").write_text(json.dumps(payload, indent=1))

    def _save_sharded(self, final: bool) -> None:
        def write_main(folder: Path, param_groups: list, full_state: dict | None):
            self.model.config.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
            if full_state is not None:  # the last checkpoint is also a model folder (clover generate, export)
                model = self.arch.blank(folder)
                model.load_state_dict(full_state)
                self.arch.save(model, self.tokenizer, folder)
            self._write_train_state(folder, {"param_groups": param_groups}, format="dcp", world_size=distributed.world_size())

        distributed.save_sharded(self.out / "checkpoint", self.model, self.optimizer, write_main, full=final)

    def train_step(self, step: int) -> dict:
        cfg, recipe = self.cfg, self.recipe
        stage = recipe.stages[self.state["stage"]]
        batch = self.mixture.batch(cfg.seed, step, cfg.batch_size)  # the global batch; self.rows are ours
        if self.device.type != "cpu":
            batch = Batch(batch.input_ids.to(self.device), batch.is_prompt.to(self.device), batch.is_pad.to(self.device))
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg, self.state["max_steps"])
        with self.autocast():
            step_loss = self.arch.loss(self.train_model, batch, stage, cfg, step, self.rows)
        step_loss.total.backward()
        grad_norm = distributed.clip_grad_norm(self.model, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.arch.after_optimizer_step(self.model)
        tokens = int((~batch.is_pad).sum())
        self.state["tokens_seen"] += tokens
        loss, accuracy = float(step_loss.loss.detach()), float(step_loss.accuracy)
        if distributed.active():
            loss, accuracy = distributed.batch_mean(loss, accuracy, step_loss.scored)
        return {
            "step": step,
            "loss": round(loss, 5),
            "acc_masked": round(accuracy, 4),
            "grad_norm": round(grad_norm, 4),
            "lr": group["lr"],
            "stage": self.state["stage"],
            "ar": step_loss.autoregressive,
            "tokens": tokens,
        }

    def _maybe_advance_stage(self, step: int, metrics: dict | None) -> None:
        stage, max_steps = self.state["stage"], self.state["max_steps"]
        stages = self.recipe.stages
        if stage + 1 >= len(stages):
            return
        if stage == 0:
            copied = metrics is not None and metrics["copy"] >= self.recipe.copy_threshold
            if not copied and step < self.recipe.warmup_max_fraction * max_steps:
                return
        else:
            # the widening stages share the steps left after the warm-up equally
            start = self.state["stage_starts"][1]
            share = (max_steps - start) / (len(stages) - 1)
            if step < start + share * stage:
                return
        self.state["stage"] = stage + 1
        self.state["stage_starts"].append(step)
        self._log({"event": "stage", "step": step, "stage": stage + 1, "block_sizes": stages[stage + 1].block_sizes})

    def calibrate_steps(self) -> int:
        """Turn a --minutes budget into a fixed step count (so the schedule and resume stay step-based)."""
        start = time.perf_counter()
        probe_steps = 3
        snapshot = {k: v.clone() for k, v in self.model.state_dict().items()}
        for step in range(probe_steps):
            self.state["max_steps"] = 10**9
            self.train_step(step)
        per_step = (time.perf_counter() - start) / probe_steps
        self.model.load_state_dict(snapshot)
        self.optimizer.state.clear()  # fresh Adam moments: the probe steps never happened
        self.state["tokens_seen"] = 0
        self.arch.reset_router_load(self.model)
        # evaluation and checkpoints take about 8% of the time
        return max(1, int(self.cfg.minutes * 60 * 0.92 / per_step))

    def run(self) -> dict:
        cfg = self.cfg
        if self.state["max_steps"] is None:
            if cfg.minutes is None:
                raise CloverError("give --max-steps or --minutes")
            self.state["max_steps"] = int(distributed.from_main(self.calibrate_steps()))  # timings differ by rank
            self._log({"event": "calibrated", "max_steps": self.state["max_steps"], "minutes": cfg.minutes})
        max_steps = self.state["max_steps"]
        start_step = self.state["step"]
        last_checkpoint = time.monotonic()
        metrics = None
        bar = tqdm(
            range(start_step, max_steps), initial=start_step, total=max_steps, desc="train", dynamic_ncols=True,
            disable=not distributed.is_main(),
        )
        started = time.perf_counter()
        tokens_this_run = 0
        for step in bar:
            record = self.train_step(step)
            tokens_this_run += record["tokens"]
            self.state["step"] = step + 1
            record["tok_s"] = round(tokens_this_run / (time.perf_counter() - started), 1)
            self._log(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tok_s']:.0f}", stage=record["stage"])
            last = step + 1 == max_steps
            metrics = None
            if (step + 1) % cfg.eval_every == 0 or last:
                metrics = self.evaluator(self.model, self.autocast)  # on every rank: FSDP's forward is collective
                metrics["copy"] = distributed.from_main(metrics["copy"])  # one stage decision for all ranks
                self._log({"event": "eval", "step": step + 1, **{k: round(v, 4) for k, v in metrics.items()}})
                if distributed.is_main():
                    bar.write(f"step {step + 1}: " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
            self._maybe_advance_stage(step + 1, metrics)
            due = (
                (step + 1) % cfg.checkpoint_every == 0
                if cfg.checkpoint_every
                else bool(distributed.from_main(time.monotonic() - last_checkpoint > cfg.checkpoint_minutes * 60))
            )
            if due or last:
                self.save_checkpoint(final=last)
                last_checkpoint = time.monotonic()
        bar.close()
        return {"steps": self.state["step"], "tokens_seen": self.state["tokens_seen"], "final_eval": metrics}
