"""Conversion fine-tuning (`clover train --recipe convert`): a LoRA adapter that turns the converted base
into a block-diffusion model, with the objective of training/objective.py.

Every step's examples and masks are a pure function of (seed, step) (training/convert_data.py), and a
checkpoint holds the adapter, the optimizer, the schedule state and the tokens seen, so `--resume` replays
exactly the steps an uninterrupted run takes. The adapter (peft LoRA on every linear layer, plus the mask
token's embedding row) is the shipped delta: `load_adapted` merges it into the base at load time.

On CUDA a step runs several packed rows padded to a multiple of `pad_multiple`: the attention kernels
see a few fixed shapes and plan once, where a new length every step made them plan afresh
(models/README.md: 82 ms of GPU time in a 1 s step). The next step's batch is built
on a host thread while the device runs the current one.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from cloverlm.convert.adapter import ADAPTER_META, save_adapter, with_adapter
from cloverlm.convert.base import DEFAULT_BASE, converted, load_base
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import (
    atomic_write_dir,
    load_optimizer_file,
    load_optimizer_state,
    optimizer_tensors,
    recover_dir,
)
from cloverlm.training.convert_data import ConversionData
from cloverlm.training.data import HELDOUT_SEED_BASE
from cloverlm.training.objective import autoregressive_loss, build_batch, conversion_loss

OBJECTIVES = ("diffusion", "ar")
DEVICES = ("auto", "cpu", "cuda")
GPU_PAD_MULTIPLE = 256


@dataclass
class ConvertConfig:
    base: str = DEFAULT_BASE
    # "diffusion": Clover (noisy answer blocks + the clean answer loss); "ar": the autoregressive peer,
    # the same base and examples with the clean answer loss only, decoded by transformers' generate.
    objective: str = "diffusion"
    out: str = "runs/convert"
    seed: int = 0
    # Sources by weight; no_fly_zones draws 20 messages with `full_size_share`, else 1..19.
    mixture: dict[str, float] = field(
        default_factory=lambda: {"no_fly_zones": 0.45, "tool_call": 0.15, "kv_retrieval": 0.1, "arithmetic": 0.05, "chat": 0.25}
    )
    full_size_share: float = 0.3
    tokens_per_step: int = 1600  # clean tokens packed into each row
    rows_per_step: int = 1
    lr: float = 5e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    lora_rank: int = 32
    lora_alpha: int = 64
    max_steps: int = 400
    minutes: float | None = None
    eval_every: int = 50
    checkpoint_every: int = 10
    device: str = "auto"  # auto: cuda when available
    # None: bf16 autocast on CUDA only. On this AVX2 CPU a bf16 forward of the 135M base took 4x as long
    # as fp32 (28 s against 7 s for 900 tokens, one thread), and bf16 autocast's backward longer still.
    bf16: bool | None = None
    # Rows are padded to a multiple of this (None: GPU_PAD_MULTIPLE on CUDA; on CPU padding only costs).
    pad_multiple: int | None = None
    compile: bool = False  # torch.compile the model (static shapes: worth it with padding on CUDA)
    chat_examples: int = 128  # the first N records of data/chat_distill/train.jsonl
    init_adapter: str | None = None  # start from this adapter folder (fresh optimizer, warm-up again)
    distill_data: str | None = None  # trajectories (training/distill.py) for the mixture's "distill" source
    certainty_weight: float = 0.0  # certainty forcing on right noisy predictions (objective.conversion_loss)


def lr_at(step: int, cfg: ConvertConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise CloverError(f"unknown device '{name}'; choose from: {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise CloverError("--device cuda: no CUDA device is visible to torch")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def adapter_lineage(folder: str | Path) -> dict:
    """What an adapter folder says of its own training: steps and tokens of its whole lineage (None where
    an older folder does not say)."""
    meta = json.loads((Path(folder) / ADAPTER_META).read_text())
    return {"path": str(folder), "objective": meta.get("objective"), "lora_rank": meta.get("lora_rank"),
            "total_steps": meta.get("total_steps", meta.get("steps")), "total_tokens": meta.get("total_tokens")}  # fmt: skip


class ConvertTrainer:
    def __init__(self, cfg: ConvertConfig, resume: bool = False):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.checkpoint = self.out / "checkpoint"
        if cfg.objective not in OBJECTIVES:
            raise CloverError(f"unknown objective '{cfg.objective}'; choose from: {', '.join(OBJECTIVES)}")
        if cfg.rows_per_step < 1:
            raise CloverError(f"rows_per_step must be at least 1, got {cfg.rows_per_step}")
        self.device = resolve_device(cfg.device)
        on_cuda = self.device.type == "cuda"
        self.autocast_bf16 = on_cuda if cfg.bf16 is None else cfg.bf16
        self.pad_multiple = (GPU_PAD_MULTIPLE if on_cuda else 1) if cfg.pad_multiple is None else cfg.pad_multiple
        model, self.tokenizer = converted(cfg.base) if cfg.objective == "diffusion" else load_base(cfg.base)
        self.model = with_adapter(model, cfg.objective, cfg.lora_rank, cfg.lora_alpha).to(self.device)
        self.forward_model = torch.compile(self.model) if cfg.compile else self.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        self.data = ConversionData(self.tokenizer, cfg)
        self.step = 0
        self.tokens = {"clean": 0, "noisy": 0}
        self.parent = None
        if resume:
            self._resume()
        elif cfg.init_adapter:
            self._init_from(cfg.init_adapter)
        self.heldout = [self.data.task_segment("no_fly_zones", HELDOUT_SEED_BASE + i, n_messages=20) for i in range(2)]
        self.heldout += [self.data.task_segment("tool_call", HELDOUT_SEED_BASE + i) for i in range(2)]

    def loss(self, batch):
        if self.cfg.objective == "ar":
            return autoregressive_loss(self.forward_model, batch)
        return conversion_loss(self.forward_model, batch, self.cfg.certainty_weight)

    def _load_adapter_weights(self, path: Path) -> None:
        from peft import set_peft_model_state_dict

        weights = {k: v.float() for k, v in load_file(str(path)).items()}
        result = set_peft_model_state_dict(self.model, weights)
        if getattr(result, "unexpected_keys", None):
            raise CloverError(f"{path} does not fit this adapter: unexpected {result.unexpected_keys[:3]}")

    def _init_from(self, folder: str) -> None:
        """Warm start: the adapter's weights, a fresh optimizer, and the schedule's warm-up from step 0."""
        folder = Path(folder)
        if not (folder / ADAPTER_META).is_file():
            raise CloverError(f"--init-adapter {folder}: not an adapter folder (no {ADAPTER_META})")
        parent = adapter_lineage(folder)
        if parent["objective"] != self.cfg.objective or parent["lora_rank"] != self.cfg.lora_rank:
            raise CloverError(f"--init-adapter {folder}: a {parent['objective']} adapter of rank {parent['lora_rank']}, "
                              f"but this run trains a {self.cfg.objective} adapter of rank {self.cfg.lora_rank}")  # fmt: skip
        self._load_adapter_weights(folder / "adapter_model.safetensors")
        self.parent = parent

    def _resume(self) -> None:
        found = recover_dir(self.checkpoint)
        if found is None:
            raise CloverError(f"--resume: no checkpoint in {self.checkpoint}")
        state = json.loads((found / "train_state.json").read_text())
        # fields added since the checkpoint was written take their defaults
        stored = asdict(ConvertConfig()) | state["config"]
        if stored != asdict(self.cfg) | {"max_steps": stored["max_steps"], "minutes": stored["minutes"]}:
            raise CloverError("--resume with a different configuration than the checkpoint's (only --max-steps/--minutes may change)")
        self._load_adapter_weights(found / "adapter_model.safetensors")
        load_optimizer_state(self.optimizer, load_optimizer_file(found / "optimizer.safetensors"), state["optimizer"])
        self.step = state["step"]
        self.tokens = state.get("tokens", self.tokens)
        self.parent = state.get("parent")

    def _save_checkpoint(self) -> None:
        def write(tmp: Path) -> None:
            self.write_adapter(tmp)
            tensors, meta = optimizer_tensors(self.optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            state = {"step": self.step, "config": asdict(self.cfg), "optimizer": meta, "tokens": self.tokens, "parent": self.parent}
            (tmp / "train_state.json").write_text(json.dumps(state))

        atomic_write_dir(self.checkpoint, write)

    def lineage(self) -> dict:
        """This run and its ancestors: the parent adapter, the steps and tokens of this run and in all."""
        tokens = sum(self.tokens.values())
        parent_steps = (self.parent or {}).get("total_steps") or 0
        parent_tokens = (self.parent or {}).get("total_tokens")
        return {
            "parent": self.parent, "steps": self.step, "tokens": dict(self.tokens), "device": device_label(self.device),
            "total_steps": parent_steps + self.step,
            # None when an ancestor did not record its tokens
            "total_tokens": None if self.parent and parent_tokens is None else (parent_tokens or 0) + tokens,
        }  # fmt: skip

    def write_adapter(self, folder: Path, dtype=torch.float32) -> None:
        meta = {"base": self.cfg.base, "objective": self.cfg.objective, "lora_rank": self.cfg.lora_rank,
                "lora_alpha": self.cfg.lora_alpha, "recipe": "convert", **self.lineage(), "config": asdict(self.cfg)}  # fmt: skip
        save_adapter(self.model, self.tokenizer, folder, meta, dtype)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        generator = torch.Generator().manual_seed(4321)
        totals: dict[str, float] = {}
        for segment in self.heldout:
            with self._autocast():
                _, stats = self.loss(build_batch([[segment]], self.data.end_id, self.data.mask_id, generator))
            for key in ("noisy_nll", "ar_nll", "noisy_acc", "ar_acc"):
                if key in stats:
                    totals[key] = totals.get(key, 0.0) + stats[key] / len(self.heldout)
        self.model.train()
        return {f"eval_{k}": round(v, 4) for k, v in totals.items()}

    def train_step(self, batch) -> tuple[float, dict]:
        """One optimizer step on `batch`; returns (loss, stats) and counts the batch's real tokens."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        with self._autocast():
            loss, stats = self.loss(batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for key, count in batch.token_counts().items():
            if key == "clean" or self.cfg.objective == "diffusion":  # the peer computes no noisy slots
                self.tokens[key] += count
        self.step += 1
        return float(loss.detach()), stats | {"grad_norm": float(norm)}

    def run(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        log = (self.out / "train_log.jsonl").open("a")
        started = time.time()
        self.model.train()
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="convert", dynamic_ncols=True)
        with ThreadPoolExecutor(max_workers=1) as host:  # builds the next step's batch during this one
            upcoming = host.submit(self.data.step_batch, self.step, self.pad_multiple)
            while self.step < cfg.max_steps:
                if cfg.minutes is not None and time.time() - started > 60 * cfg.minutes:
                    break
                batch = upcoming.result()
                if self.step + 1 < cfg.max_steps:
                    upcoming = host.submit(self.data.step_batch, self.step + 1, self.pad_multiple)
                lr = lr_at(self.step, cfg)
                loss, stats = self.train_step(batch)
                record = {"step": self.step, "loss": round(loss, 4), "lr": lr, **{k: round(v, 4) for k, v in stats.items()},
                          "elapsed_s": round(time.time() - started, 1)}  # fmt: skip
                if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                    record.update(self.evaluate())
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix({k: stats[k] for k in ("noisy_nll", "ar_nll") if k in stats})
                if self.step % cfg.checkpoint_every == 0:
                    self._save_checkpoint()
        bar.close()
        self._save_checkpoint()
        # The shipped delta in bf16 (under 30 MB at rank 32); the checkpoint keeps fp32 for exact resume.
        atomic_write_dir(self.out / "adapter", lambda folder: self.write_adapter(folder, torch.bfloat16))
        return {"step": self.step, "out": str(self.out / "adapter"), **self.lineage()}
