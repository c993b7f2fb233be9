"""Block-diffusion training: the recipe, the loop, evaluation, checkpoints and exact resume.

Run: `clover train --preset clover-tiny --recipe default --minutes 60 --out runs/tiny`.
Every batch and every mask is a pure function of (seed, step), and checkpoints hold the weights,
optimizer and schedule state, so `--resume` replays exactly the steps an uninterrupted run takes.
`--arch qwen3.5-moe` trains the same-size autoregressive peer (peer.py) on the same data and schedule.
Under torchrun the same loop runs data-parallel (distributed.py): same global batch, same losses.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from cloverlm.convert import peer
from cloverlm.convert.load import load_model
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import (
    atomic_write_dir,
    load_optimizer_file,
    load_optimizer_state,
    optimizer_tensors,
    read_config,
    recover_dir,
    save_model,
)
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.config import CloverConfig, preset_config
from cloverlm.model.layout import fixed_partition
from cloverlm.tokenizer import load_tokenizer
from cloverlm.training import distributed
from cloverlm.training.data import Batch, Mixture, build_default_tokenizer, heldout_examples, tokenize_stdlib
from cloverlm.training.diffusion import (
    diffusion_loss,
    mask_blocks,
    sample_partition,
    shift_noise,
)

# ----------------------------------------------------------------------------------------------
# Recipes


@dataclass
class Stage:
    """One step of the block-size curriculum."""

    block_sizes: list[int]
    ar_fraction: float  # share of batches trained as pure next-token prediction (B = 1, t = 1)
    chat_mode: bool  # prompt tokens of task examples never masked nor scored


@dataclass
class Recipe:
    mixture: dict[str, float]
    stages: list[Stage]
    # Leave stage 0 (next-token warm-up) once the copy probe reaches this, or at this fraction of steps.
    copy_threshold: float = 0.6
    warmup_max_fraction: float = 0.5
    task_sizes: dict[str, dict] = field(default_factory=dict)  # kwargs ranges per generator


RECIPES = {
    # Design section 3: next-token warm-up until the model copies, then widen 1 -> 4 -> 16 -> 32, always
    # keeping some pure B = 1 batches. Answer-only loss on task rows (random digits in prompts are pure
    # noise to a language-model loss). Copying is the scarce skill on a CPU budget, so the mixture is
    # built for it: short prompts (1-4 messages, 4-16 pairs) pack many copy events into each step, half
    # the rows are no-fly zones, and the `repeat` task trains copying on its own. Measured here: 1-8
    # messages at 35% had not started copying after 1,200 steps (models/README.md); the peer trained on
    # one-message no-fly prompts alone starts copying at about 1,200 steps of 2,048 tokens.
    "default": Recipe(
        mixture={
            "stdlib": 0.05,
            "repeat": 0.15,
            "no_fly_zones": 0.5,
            "kv_retrieval": 0.15,
            "tool_call": 0.1,
            "arithmetic": 0.05,
        },
        stages=[
            Stage([1], 1.0, chat_mode=True),
            Stage([1, 4], 0.3, chat_mode=True),
            Stage([1, 4, 8, 16], 0.25, chat_mode=True),
            Stage([1, 4, 8, 16, 32], 0.25, chat_mode=True),
        ],
        copy_threshold=0.8,
        warmup_max_fraction=0.65,
        task_sizes={
            "no_fly_zones": {"n_messages": (1, 4)},
            "kv_retrieval": {"n_pairs": (4, 16)},
            "repeat": {"n_items": (2, 16)},
        },
    ),
}


@dataclass
class TrainConfig:
    preset: str = "clover-tiny"
    recipe: str = "default"
    arch: str = "clover"  # or "qwen3.5-moe": the same-size autoregressive peer (see ARCHS)
    out: str = "runs/clover-tiny"
    seed: int = 0
    seq_len: int = 1024
    batch_size: int = 2
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = None
    minutes: float | None = None
    eval_every: int = 100
    checkpoint_minutes: float = 5.0
    checkpoint_every: int | None = None  # in steps; overrides checkpoint_minutes (tests)
    bf16: bool = True
    tokenizer: str | None = None
    init_from: str | None = None  # a model folder to start from instead of random weights
    overrides: dict = field(default_factory=dict)  # CloverConfig fields
    probe_examples: int = 8


def lr_at(step: int, cfg: TrainConfig, max_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def copy_probe(model, examples, block_size: int) -> float:
    """Accuracy on masked value tokens of task answers (ids, coordinates, values) with the rest given."""
    correct = total = 0
    for ex in examples:
        if not ex.value_positions:
            continue
        ids = torch.tensor([ex.ids], device=model.device)
        masked = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
        masked[0, [p - 1 for p in ex.value_positions]] = True  # target index of token p is p - 1
        sizes = fixed_partition(ids.shape[1] - 1, block_size)
        noisy = shift_noise(ids, masked, sizes, model.config.mask_token_id)
        logits = model(ids[:, :-1], noisy, sizes, logits_mask=masked).logits
        correct += int((logits.argmax(-1) == ids[:, 1:][masked]).sum())
        total += int(masked.sum())
    return correct / max(total, 1)


@torch.no_grad()
def heldout_elbo(model, windows: torch.Tensor, block_size: int, seed: int = 1234) -> float:
    """Masked-diffusion ELBO per token on held-out stdlib windows (block size 1 = next-token NLL)."""
    generator = torch.Generator().manual_seed(seed)
    sizes = fixed_partition(windows.shape[1] - 1, block_size)
    eligible = torch.ones_like(windows, dtype=torch.bool)
    noised = mask_blocks(
        windows, eligible, sizes, model.config.mask_token_id, generator, t_fixed=1.0 if block_size == 1 else None
    )
    return float(diffusion_loss(model, noised, sizes)[0])


def fitting_examples(tokenizer, task: str, count: int, max_len: int, size_key: str | None, full: int):
    """Held-out examples at the largest size (halving from `full`) whose prompts fit `max_len` tokens."""
    size = full
    while True:
        try:
            return heldout_examples(tokenizer, task, count, max_len, **({size_key: size} if size_key else {}))
        except CloverError:
            if size_key is None or size <= 1:
                raise
            size //= 2


class Evaluator:
    """Held-out windows and copy probes, scored by an architecture's `metrics`."""

    def __init__(self, tokenizer, cfg: TrainConfig, val_tokens: torch.Tensor, metrics):
        self.metrics = metrics
        rng = random.Random(99)
        length = min(cfg.seq_len, 512)
        starts = [rng.randrange(len(val_tokens) - length) for _ in range(4)]
        self.windows = torch.stack([val_tokens[s : s + length] for s in starts]).long()
        # Full-size prompts when the context allows, fewer messages / pairs when it does not.
        self.probe = {
            task: fitting_examples(tokenizer, task, cfg.probe_examples, cfg.seq_len, key, full)
            for task, key, full in (
                ("no_fly_zones", "n_messages", 20),
                ("kv_retrieval", "n_pairs", 60),
                ("tool_call", None, 0),
                ("repeat", "n_items", 8),
            )
        }

    def __call__(self, model, autocast) -> dict[str, float]:
        was_training = model.training
        model.eval()
        with autocast():
            metrics = self.metrics(model, self.windows.to(model.device), self.probe)
        metrics["copy"] = sum(metrics[f"copy_{t}_b1"] for t in self.probe) / len(self.probe)
        model.train(was_training)
        return metrics


# ----------------------------------------------------------------------------------------------
# Architectures: the parts of training that depend on the model (everything else is shared)


@dataclass
class StepLoss:
    loss: torch.Tensor  # the objective, as logged
    total: torch.Tensor  # what is backpropagated: the objective plus router balancing
    accuracy: torch.Tensor  # argmax accuracy on the scored positions
    autoregressive: bool  # the batch was scored as pure next-token prediction
    scored: int  # how many positions the accuracy is over (to combine the ranks' accuracies)


def rank_share(eligible: torch.Tensor, rows: slice) -> torch.Tensor:
    """Turns a loss normalised by this rank's eligible tokens into its estimate of the whole batch's:
    the ELBO divides by the batch's eligible tokens, and DDP / FSDP average the ranks' gradients."""
    return distributed.world_size() * eligible[rows].sum().clamp(min=1) / eligible.sum().clamp(min=1)


class Arch(Protocol):
    def build(self, config: CloverConfig) -> torch.nn.Module:
        """A random model of the size of `config` (torch is seeded beforehand)."""

    def load(self, folder: Path) -> torch.nn.Module: ...

    def save(self, model, tokenizer, folder: Path) -> None: ...

    def loss(self, model, batch: Batch, stage: Stage, cfg: TrainConfig, step: int, rows: slice) -> StepLoss:
        """The training loss of this process's `rows` of the global batch, normalised as the whole
        batch's (rank_share); any randomness must be a function of (cfg.seed, step), not of the rows."""

    def blank(self, folder: Path) -> torch.nn.Module:
        """The folder's architecture (config.json) with untrained weights, for a sharded checkpoint to fill."""

    def after_optimizer_step(self, model) -> None:
        """Bookkeeping outside the gradient (Clover's routing-bias update)."""

    def reset_router_load(self, model) -> None:
        """Forget the expert load counted so far (the calibration steps never happened)."""

    def metrics(self, model, windows: torch.Tensor, probe: dict[str, list]) -> dict[str, float]:
        """Held-out scores; must include copy_<task>_b1 for every probe task (the warm-up's exit)."""


class CloverArch:
    """Block diffusion: a random block partition and masking per batch, the 1/t-weighted ELBO."""

    def build(self, config):
        return CloverForBlockDiffusion(config)

    def load(self, folder):
        return load_model(folder)

    def blank(self, folder):
        return CloverForBlockDiffusion(read_config(CloverConfig, folder))

    def save(self, model, tokenizer, folder):
        save_model(model, tokenizer, folder)

    def loss(self, model, batch, stage, cfg, step, rows):
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        autoregressive = float(torch.rand(1, generator=generator)) < stage.ar_fraction
        if autoregressive:
            sizes, t_fixed = [1] * (cfg.seq_len - 1), 1.0
        else:
            sizes, t_fixed = sample_partition(cfg.seq_len - 1, stage.block_sizes, generator), None
        eligible = batch.eligible(stage.chat_mode)
        # noise for the whole batch, then this rank's rows: each row is masked as in a 1-process run
        noised = mask_blocks(batch.input_ids, eligible, sizes, model.config.mask_token_id, generator, t_fixed=t_fixed)
        loss, aux, stats = diffusion_loss(model, noised.rows(rows), sizes)
        if distributed.active():
            loss = loss * rank_share(noised.eligible, rows)
        total = loss + model.config.router_aux_loss_coef * aux
        return StepLoss(loss, total, stats["acc_masked"], autoregressive, stats["masked_tokens"])

    def after_optimizer_step(self, model):
        model.update_router_bias()

    def reset_router_load(self, model):
        for block in model.moe_blocks():
            block.expert_load.zero_()

    def metrics(self, model, windows, probe):
        metrics = {"elbo_b1": heldout_elbo(model, windows, 1), "elbo_b16": heldout_elbo(model, windows, 16)}
        for task, examples in probe.items():
            for block in (1, 16):
                metrics[f"copy_{task}_b{block}"] = copy_probe(model, examples, block)
        return metrics


class PeerArch:
    """The autoregressive peer (Qwen3.5-MoE): next-token loss on the tokens Clover scores; no block
    stages, but the current stage's chat_mode, so that both models learn from the same tokens."""

    def build(self, config):
        return peer.build_peer(peer.peer_config(config))

    def load(self, folder):
        return peer.load_peer(folder)

    def blank(self, folder):
        return peer.build_peer(read_config(peer.Qwen3_5MoeTextConfig, folder))

    def save(self, model, tokenizer, folder):
        peer.save_peer(model, tokenizer, folder)

    def loss(self, model, batch, stage, cfg, step, rows):
        eligible = batch.eligible(stage.chat_mode)
        loss, aux, accuracy = peer.next_token_loss(model, batch.input_ids[rows], eligible[rows])
        scored = eligible[:, 1:]  # position 0 is never predicted
        if distributed.active():
            # transformers' balancing loss sees this rank's tokens only: exact for the ELBO, not for aux
            loss = loss * rank_share(scored, rows)
        total = loss + model.config.router_aux_loss_coef * aux
        return StepLoss(loss, total, accuracy, autoregressive=True, scored=int(scored[rows].sum()))

    def after_optimizer_step(self, model):
        pass  # balancing is the aux loss alone: Qwen3.5-MoE has no routing bias

    def reset_router_load(self, model):
        pass  # no load is counted between steps

    def metrics(self, model, windows, probe):
        metrics = {"elbo_b1": peer.heldout_nll(model, windows)}
        for task, examples in probe.items():
            metrics[f"copy_{task}_b1"] = peer.copy_accuracy(model, examples)
        return metrics


ARCHS: dict[str, Arch] = {"clover": CloverArch(), peer.PEER_ARCH: PeerArch()}


# ----------------------------------------------------------------------------------------------
# The loop


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
        if cfg.seq_len % 64:
            raise CloverError(f"seq_len={cfg.seq_len} must be a multiple of 64 (the chunk size)")
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


def main(argv=None) -> None:
    """`python -m cloverlm.training.train` is the same as `clover train`."""
    from cloverlm.cli import main as cli_main

    cli_main(["train", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    main()
