"""Conversion fine-tuning (`clover train --recipe convert`): a LoRA adapter that turns the converted base
into a block-diffusion model, with the objective of convert_objective.py.

Every step's examples and masks are a pure function of (seed, step), and a checkpoint holds the adapter,
the optimizer and the schedule state, so `--resume` replays exactly the steps an uninterrupted run takes.
The adapter (peft LoRA on every linear layer, plus the mask token's embedding row) is the shipped delta:
`load_adapted` merges it into the base at load time.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from cloverlm import tasks
from cloverlm.convert.adapter import save_adapter, with_adapter
from cloverlm.convert.base import DEFAULT_BASE, check_tokenizer, converted, load_base
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import (
    atomic_write_dir,
    load_optimizer_file,
    load_optimizer_state,
    optimizer_tensors,
    recover_dir,
)
from cloverlm.tokenizer import format_chat
from cloverlm.training.data import HELDOUT_SEED_BASE, encode_example
from cloverlm.training.objective import Segment, autoregressive_loss, build_batch, conversion_loss

CHAT_DATA = Path(__file__).resolve().parents[2] / "data" / "chat_distill"


OBJECTIVES = ("diffusion", "ar")


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
    tokens_per_step: int = 1600  # examples are packed into one sequence up to this many clean tokens
    lr: float = 5e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    lora_rank: int = 32
    lora_alpha: int = 64
    max_steps: int = 400
    minutes: float | None = None
    eval_every: int = 50
    checkpoint_every: int = 10
    # fp32: on this AVX2 CPU a bf16 forward of the 135M base took 4x as long as fp32 (28 s against 7 s
    # for 900 tokens, one thread), and bf16 autocast's backward longer still.
    bf16: bool = False
    chat_examples: int = 128  # the first N records of data/chat_distill/train.jsonl


def lr_at(step: int, cfg: ConvertConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def read_chat(split: str) -> list[dict]:
    path = CHAT_DATA / f"{split}.jsonl"
    if not path.is_file():
        raise CloverError(f"self-distilled chat data missing: {path} (make it with scripts/distill_chat.py)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ConversionData:
    """Examples of the mixture as (prompt ids, answer ids) segments."""

    def __init__(self, tokenizer, cfg: ConvertConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.mask_id = check_tokenizer(tokenizer)
        self.chat = read_chat("train")[: cfg.chat_examples] if cfg.mixture.get("chat") else []

    def task_segment(self, name: str, seed: int, **size) -> Segment:
        encoded = encode_example(self.tokenizer, tasks.generate(name, seed, **size))
        return Segment(encoded.ids[: encoded.prompt_length], encoded.ids[encoded.prompt_length :])

    def chat_segment(self, record: dict) -> Segment:
        prompt_text, _ = format_chat(self.tokenizer, record["prompt"])
        prompt = self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        if record["finish"] == "stop":
            return Segment(prompt, list(record["answer_ids"]) + [self.end_id])
        return Segment(prompt, list(record["answer_ids"]), complete=False)  # cut at the distillation's limit

    def sample(self, rng: random.Random) -> Segment:
        sources = list(self.cfg.mixture)
        source = rng.choices(sources, [self.cfg.mixture[s] for s in sources])[0]
        if source == "chat":
            return self.chat_segment(rng.choice(self.chat))
        seed = rng.randrange(HELDOUT_SEED_BASE)
        if source == "no_fly_zones":
            full = rng.random() < self.cfg.full_size_share
            return self.task_segment(source, seed, n_messages=20 if full else rng.randint(1, 19))
        if source == "kv_retrieval":
            return self.task_segment(source, seed, n_pairs=rng.randint(4, 60))
        return self.task_segment(source, seed)

    def step_segments(self, step: int) -> list[Segment]:
        """Examples for one step, packed up to tokens_per_step; an example that does not fit is skipped
        (three misses end the packing), except the first, which is taken whatever its size."""
        rng = random.Random(f"{self.cfg.seed}/{step}")
        segments, used, misses = [], 0, 0
        while used < self.cfg.tokens_per_step and misses < 3:
            segment = self.sample(rng)
            size = len(segment.prompt) + len(segment.answer) + 16  # + block padding, on average
            if segments and used + size > self.cfg.tokens_per_step:
                misses += 1
                continue
            segments.append(segment)
            used += size
        return segments


class ConvertTrainer:
    def __init__(self, cfg: ConvertConfig, resume: bool = False):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.checkpoint = self.out / "checkpoint"
        if cfg.objective not in OBJECTIVES:
            raise CloverError(f"unknown objective '{cfg.objective}'; choose from: {', '.join(OBJECTIVES)}")
        model, self.tokenizer = converted(cfg.base) if cfg.objective == "diffusion" else load_base(cfg.base)
        self.model = with_adapter(model, cfg.objective, cfg.lora_rank, cfg.lora_alpha)
        self.loss = conversion_loss if cfg.objective == "diffusion" else autoregressive_loss
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        self.data = ConversionData(self.tokenizer, cfg)
        self.step = 0
        if resume:
            self._resume()
        self.heldout = [self.data.task_segment("no_fly_zones", HELDOUT_SEED_BASE + i, n_messages=20) for i in range(2)]
        self.heldout += [self.data.task_segment("tool_call", HELDOUT_SEED_BASE + i) for i in range(2)]

    def _resume(self) -> None:
        from peft import set_peft_model_state_dict

        found = recover_dir(self.checkpoint)
        if found is None:
            raise CloverError(f"--resume: no checkpoint in {self.checkpoint}")
        state = json.loads((found / "train_state.json").read_text())
        # fields added since the checkpoint was written take their defaults
        stored = asdict(ConvertConfig()) | state["config"]
        if stored != asdict(self.cfg) | {"max_steps": stored["max_steps"], "minutes": stored["minutes"]}:
            raise CloverError("--resume with a different configuration than the checkpoint's (only --max-steps/--minutes may change)")
        set_peft_model_state_dict(self.model, load_file(str(found / "adapter_model.safetensors")))
        load_optimizer_state(self.optimizer, load_optimizer_file(found / "optimizer.safetensors"), state["optimizer"])
        self.step = state["step"]

    def _save_checkpoint(self) -> None:
        def write(tmp: Path) -> None:
            self.cfg_meta_write(tmp)
            tensors, meta = optimizer_tensors(self.optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            (tmp / "train_state.json").write_text(json.dumps({"step": self.step, "config": asdict(self.cfg), "optimizer": meta}))

        atomic_write_dir(self.checkpoint, write)

    def cfg_meta_write(self, folder: Path, dtype=torch.float32) -> None:
        meta = {"base": self.cfg.base, "objective": self.cfg.objective, "lora_rank": self.cfg.lora_rank,
                "lora_alpha": self.cfg.lora_alpha, "steps": self.step, "recipe": "convert", "config": asdict(self.cfg)}  # fmt: skip
        save_adapter(self.model, self.tokenizer, folder, meta, dtype)

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        generator = torch.Generator().manual_seed(4321)
        totals: dict[str, float] = {}
        for segment in self.heldout:
            with self._autocast():
                _, stats = self.loss(self.model, build_batch([segment], self.data.end_id, self.data.mask_id, generator))
            for key in ("noisy_nll", "ar_nll", "noisy_acc", "ar_acc"):
                if key in stats:
                    totals[key] = totals.get(key, 0.0) + stats[key] / len(self.heldout)
        self.model.train()
        return {f"eval_{k}": round(v, 4) for k, v in totals.items()}

    def run(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        log = (self.out / "train_log.jsonl").open("a")
        started = time.time()
        mask_id = self.data.mask_id
        self.model.train()
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="convert", dynamic_ncols=True)
        while self.step < cfg.max_steps:
            if cfg.minutes is not None and time.time() - started > 60 * cfg.minutes:
                break
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
            batch = build_batch(self.data.step_segments(self.step), self.data.end_id, mask_id, generator)
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.step, cfg)
            with self._autocast():
                loss, stats = self.loss(self.model, batch)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            record = {"step": self.step, "loss": round(float(loss.detach()), 4), "lr": lr_at(self.step - 1, cfg),
                      "grad_norm": round(float(norm), 3), **{k: round(v, 4) for k, v in stats.items()},
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
        atomic_write_dir(self.out / "adapter", lambda folder: self.cfg_meta_write(folder, torch.bfloat16))
        return {"step": self.step, "out": str(self.out / "adapter")}
