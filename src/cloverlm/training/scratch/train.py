"""Block-diffusion training from scratch: the objective the shared loop (loop.py) runs.

Run: `clover train --preset clover-tiny --recipe default --minutes 60 --out runs/tiny`.
The recipe and settings are recipe.py, the held-out scores probes.py; `--arch qwen3.5-moe` trains
the same-size autoregressive peer on the same data and schedule (archs.py). Checkpoints are full model
folders (the last one is the run's model), and `--minutes` without `--max-steps` becomes a fixed step
count, so that the schedule and resume stay step-based.
Under torchrun the same loop runs data-parallel (distributed.py): same global batch, same losses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import multiplies_bf16
from cloverlm.model.config import CHUNK_SIZE, preset_config
from cloverlm.tokenizer import load_tokenizer
from cloverlm.training import distributed
from cloverlm.training.loop import Loop
from cloverlm.training.scratch.archs import ARCHS
from cloverlm.training.scratch.data import Batch, Mixture, build_default_tokenizer, tokenize_stdlib
from cloverlm.training.scratch.probes import Evaluator
from cloverlm.training.scratch.recipe import RECIPES, TrainConfig


class Trainer(Loop):
    betas = (0.9, 0.95)

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.recipe = RECIPES.get(cfg.recipe)
        if self.recipe is None:
            raise CloverError(f"unknown recipe '{cfg.recipe}'; choose from: {', '.join(RECIPES)}")
        self.arch = ARCHS.get(cfg.arch)
        if self.arch is None:
            raise CloverError(f"unknown arch '{cfg.arch}'; choose from: {', '.join(ARCHS)}")
        if cfg.seq_len % CHUNK_SIZE:
            raise CloverError(f"seq_len={cfg.seq_len} must be a multiple of {CHUNK_SIZE} (the chunk size)")
        self.device = distributed.init()
        self.bf16 = multiplies_bf16(self.device) if cfg.bf16 is None else cfg.bf16
        self.rows = distributed.shard_rows(cfg.batch_size)
        super().__init__(cfg, resume, stage=0, stage_starts=[0], tokens_seen=0)
        if self.resumed is not None:
            saved_arch = self.saved["config"].get("arch", "clover")
            if saved_arch != cfg.arch:
                raise CloverError(f"{self.out} is a run of --arch {saved_arch}; resume it with the same --arch")
            self.tokenizer = load_tokenizer(self.resumed)
            sharded = self.saved.get("format") == "dcp"
            if not sharded and distributed.active() and distributed.strategy() == "fsdp":
                raise CloverError(f"{self.resumed} was saved by one process; resume it without torchrun or with CLOVER_PARALLEL=ddp")
            self.model = (self.arch.blank(self.resumed) if sharded else self.arch.load(self.resumed)).train()
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
        self.start()
        stdlib = tokenize_stdlib(self.tokenizer, "train") if self.recipe.mixture.get("stdlib") else None
        self.mixture = Mixture(self.tokenizer, self.recipe.mixture, cfg.seq_len, stdlib, self.recipe.task_sizes)
        # a spread of 1 in 10 test files is plenty for four evaluation windows
        self.evaluator = Evaluator(self.tokenizer, cfg, tokenize_stdlib(self.tokenizer, "val", every=10), self.arch.metrics)

    def _default_tokenizer(self):
        if not distributed.active():
            return build_default_tokenizer()
        # BPE training is not promised to be deterministic: rank 0 trains it, the others read its files
        folder = self.out / "tokenizer"
        if distributed.is_main():
            build_default_tokenizer().save_pretrained(folder)
        distributed.barrier()
        return load_tokenizer(folder)

    def param_groups(self) -> list[dict]:
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (decay if param.ndim >= 2 and "embed" not in name else no_decay).append(param)
        return [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def batch(self, step: int) -> Batch:
        return self.mixture.batch(self.cfg.seed, step, self.cfg.batch_size)  # the global batch; self.rows are ours

    def loss(self, batch: Batch, step: int):
        stage = self.recipe.stages[self.state["stage"]]
        if self.device.type != "cpu":
            batch = Batch(batch.input_ids.to(self.device), batch.is_prompt.to(self.device), batch.is_pad.to(self.device))
        step_loss = self.arch.loss(self.train_model, batch, stage, self.cfg, step, self.rows)
        return step_loss.total, step_loss

    def after_step(self, batch: Batch, total, step_loss) -> dict:
        self.arch.after_optimizer_step(self.model)
        tokens = int((~batch.is_pad).sum())
        self.state["tokens_seen"] += tokens
        loss, accuracy = float(step_loss.loss.detach()), float(step_loss.accuracy)
        if distributed.active():
            loss, accuracy = distributed.batch_mean(loss, accuracy, step_loss.scored)
        stage, autoregressive = self.state["stage"], step_loss.autoregressive
        return {"loss": loss, "acc_masked": accuracy, "stage": stage, "ar": autoregressive, "tokens": tokens}

    def evaluate(self) -> dict[str, float]:
        metrics = self.evaluator(self.model, self.autocast)
        metrics["copy"] = distributed.from_main(metrics["copy"])  # one stage decision for all ranks
        return metrics

    def advance(self, steps_done: int, metrics: dict | None) -> list[dict]:
        """The block-size curriculum: leave the next-token warm-up once the copy probe passes (or at its
        share of the steps), then widen at equal shares of the steps left."""
        stage, max_steps = self.state["stage"], self.state["max_steps"]
        stages = self.recipe.stages
        if stage + 1 >= len(stages):
            return []
        if stage == 0:
            copied = metrics is not None and metrics["copy"] >= self.recipe.copy_threshold
            if not copied and steps_done < self.recipe.warmup_max_fraction * max_steps:
                return []
        else:
            start = self.state["stage_starts"][1]
            share = (max_steps - start) / (len(stages) - 1)
            if steps_done < start + share * stage:
                return []
        self.state["stage"] = stage + 1
        self.state["stage_starts"].append(steps_done)
        return [{"event": "stage", "step": steps_done, "stage": stage + 1, "block_sizes": stages[stage + 1].block_sizes}]

    def save_weights(self, folder: Path) -> None:
        self.arch.save(self.model, self.tokenizer, folder)

    def save_sharded_main(self, folder: Path, full_state: dict | None) -> None:
        self.model.config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        if full_state is not None:  # the last checkpoint is also a model folder (clover generate, export)
            model = self.arch.blank(folder)
            model.load_state_dict(full_state)
            self.arch.save(model, self.tokenizer, folder)

    def forget_calibration(self) -> None:
        self.arch.reset_router_load(self.model)

    def postfix(self, record: dict) -> dict:
        return {"loss": f"{record['loss']:.3f}", "tok_s": f"{record['tok_s']:.0f}", "stage": record["stage"]}

    def finish(self, metrics: dict | None) -> dict:
        return {"steps": self.state["step"], "tokens_seen": self.state["tokens_seen"], "final_eval": metrics}
