"""Conversion fine-tuning (`clover train --recipe convert`): a LoRA adapter that turns the converted base
into a block-diffusion model, with the objective of objective.py; the same adapter trainer makes
the autoregressive peer (objective "ar") and, on the model's own right answers, distillation
(`--recipe distill`, training/conversion/distill.py). The shared loop (loop.py) runs it.

Every step's examples and masks are a pure function of (seed, step) (training/conversion/data.py), and a
checkpoint holds the adapter, the optimizer, the schedule state, the tokens seen and the parent adapter,
so `--resume` replays exactly the steps an uninterrupted run takes. The adapter (peft LoRA on every
linear layer, plus the mask token's embedding row) is the shipped delta: `load_adapted` merges it into
the base at load time.

On CUDA a step runs several packed rows padded to a multiple of `pad_multiple`: the attention kernels
see a few fixed shapes and plan once, where a new length every step made them plan afresh
(models/README.md: 82 ms of GPU time in a 1 s step).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from cloverlm.convert.adapter import ADAPTER_META, save_adapter, with_adapter
from cloverlm.convert.base import converted, load_base
from cloverlm.errors import CloverError
from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE
from cloverlm.model.checkpoint import atomic_write_dir, multiplies_bf16
from cloverlm.training.conversion.config import DEVICES, GPU_PAD_MULTIPLE, OBJECTIVES, ConvertConfig
from cloverlm.training.conversion.data import ConversionData
from cloverlm.training.conversion.frozen_base import frozen_linears_to, token_rows_apart
from cloverlm.training.conversion.objective import autoregressive_loss, build_batch, conversion_loss
from cloverlm.training.loop import Loop


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


RESUME_MAY_CHANGE = ("max_steps", "minutes", "out", "init_adapter", "device", "mixture", "chat_examples", "noisy_draws")


class ConvertTrainer(Loop):
    label = "convert"
    log_steps_done = True
    eval_as_event = False

    def __init__(self, cfg: ConvertConfig, resume: bool = False):
        if cfg.objective not in OBJECTIVES:
            raise CloverError(f"unknown objective '{cfg.objective}'; choose from: {', '.join(OBJECTIVES)}")
        if cfg.rows_per_step < 1:
            raise CloverError(f"rows_per_step must be at least 1, got {cfg.rows_per_step}")
        self.device = resolve_device(cfg.device)
        super().__init__(cfg, resume, tokens={"clean": 0, "noisy": 0}, parent=None)
        if self.saved is not None:
            stored = asdict(ConvertConfig()) | self.saved["config"]  # fields added since take their defaults
            # what may differ: the length, where the run folder and the warm start's folder now are, the
            # machine (a run moves between sessions and devices) and the data drawn from (the mixture, the chat
            # records and the noisy draws per block: a step's batch is a function of the step and the config,
            # so the run still resumes exactly; campaign.py changes them only when asked);
            # the model, the schedule and the step's shape may not
            free = {key: stored[key] for key in RESUME_MAY_CHANGE}
            if stored != asdict(cfg) | free:
                changed = sorted(k for k, v in asdict(cfg).items() if k not in free and stored.get(k) != v)
                raise CloverError(f"--resume with a different configuration than the checkpoint's: {', '.join(changed)} "
                                  f"(only {', '.join(RESUME_MAY_CHANGE)} may change)")  # fmt: skip
        on_cuda = self.device.type == "cuda"
        self.bf16 = multiplies_bf16(self.device) if cfg.bf16 is None else cfg.bf16
        # CUDA keeps one dense mask over fixed shapes; the CPU's kernel computes every tile it is given, so
        # there attention takes only what the mask allows (NoisyBlocks.segments)
        self.segmented = not on_cuda and cfg.objective == "diffusion"
        self.row_by_row = not on_cuda  # micro_batches
        self.pad_multiple = (
            (GPU_PAD_MULTIPLE if on_cuda else 1) if cfg.pad_multiple is None else cfg.pad_multiple
        )
        model, self.tokenizer = converted(cfg.base) if cfg.objective == "diffusion" else load_base(cfg.base)
        self.model = with_adapter(model, cfg.objective, cfg.lora_rank, cfg.lora_alpha).to(self.device).train()
        if self.bf16:
            frozen_linears_to(self.model, torch.bfloat16)
        token_rows_apart(self.model, torch.bfloat16 if self.bf16 else torch.float32)
        self.forward_model = torch.compile(self.model) if cfg.compile else self.model
        if self.resumed is not None:
            self._load_adapter_weights(self.resumed / "adapter_model.safetensors")
        elif cfg.init_adapter:
            self._init_from(cfg.init_adapter)
        self.start()
        self.data = ConversionData(self.tokenizer, cfg)
        self.heldout = [
            self.data.task_segment("no_fly_zones", HELDOUT_SEED_BASE + i, n_messages=20) for i in range(2)
        ]
        self.heldout += [self.data.task_segment("tool_call", HELDOUT_SEED_BASE + i) for i in range(2)]

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def tokens(self) -> dict[str, int]:
        """Real tokens trained on: clean positions, and noisy slots (Clover only)."""
        return self.state["tokens"]

    @property
    def parent(self) -> dict | None:
        """The lineage of the adapter this run started from (adapter_lineage), or None."""
        return self.state["parent"]

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
        self.state["parent"] = parent

    def lineage(self) -> dict:
        """This run and its ancestors: the parent adapter, the steps and tokens of this run and in all."""
        tokens = sum(self.tokens.values())
        parent_steps = (self.parent or {}).get("total_steps") or 0
        parent_tokens = (self.parent or {}).get("total_tokens")
        return {
            "parent": self.parent, "steps": self.step, "tokens": dict(self.tokens), "device": device_label(self.device),
            "compute": "bf16 autocast" if self.bf16 else "fp32",
            "total_steps": parent_steps + self.step,
            # None when an ancestor did not record its tokens
            "total_tokens": None if self.parent and parent_tokens is None else (parent_tokens or 0) + tokens,
        }  # fmt: skip

    def write_adapter(self, folder: Path, dtype=torch.float32) -> None:
        meta = {"base": self.cfg.base, "objective": self.cfg.objective, "lora_rank": self.cfg.lora_rank,
                "lora_alpha": self.cfg.lora_alpha, "recipe": "convert", **self.lineage(), "config": asdict(self.cfg)}  # fmt: skip
        save_adapter(self.model, self.tokenizer, folder, meta, dtype)

    def objective_loss(self, batch):
        """(loss, stats) of this run's objective on a conversion batch."""
        if self.cfg.objective == "ar":
            return autoregressive_loss(self.forward_model, batch)
        return conversion_loss(self.forward_model, batch, self.cfg.certainty_weight)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        generator = torch.Generator().manual_seed(4321)
        totals: dict[str, float] = {}
        for segment in self.heldout:
            with self.autocast():
                batch = build_batch(
                    [[segment]], self.data.end_id, self.data.mask_id, generator, segmented=self.segmented
                )
                _, stats = self.objective_loss(batch)
            for key in ("noisy_nll", "ar_nll", "noisy_acc", "ar_acc"):
                if key in stats:
                    totals[key] = totals.get(key, 0.0) + stats[key] / len(self.heldout)
        self.model.train()
        return {f"eval_{k}": round(v, 4) for k, v in totals.items()}

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.model.parameters() if p.requires_grad], "weight_decay": 0.0}]

    def batch(self, step: int):
        return self.data.step_batch(step, self.pad_multiple, self.segmented)

    def loss(self, batch, step: int):
        return self.objective_loss(batch)

    def micro_batches(self, batch):
        """On the CPU, row by row: no padding computed and half the peak memory (the same gradients)."""
        if self.row_by_row and batch.clean_ids.shape[0] > 1 and not self.cfg.certainty_weight:
            return batch.rows_apart()
        return [batch]

    def merge(self, outs: list[dict]) -> dict:
        return {key: sum(out[key] for out in outs) for key in outs[0]}  # each row's share of the batch's

    def after_step(self, batch, total, stats) -> dict:
        for key, count in batch.token_counts().items():
            if key == "clean" or self.cfg.objective == "diffusion":  # the peer computes no noisy slots
                self.tokens[key] += count
        return {"loss": float(total.detach()), **stats}

    def save_weights(self, folder: Path) -> None:
        self.write_adapter(folder)

    def postfix(self, record: dict) -> dict:
        return {k: record[k] for k in ("noisy_nll", "ar_nll") if k in record}

    def finish(self, metrics: dict | None) -> dict:
        # The shipped delta in bf16 (under 30 MB at rank 32); the checkpoint keeps fp32 for exact resume.
        atomic_write_dir(self.out / "adapter", lambda folder: self.write_adapter(folder, torch.bfloat16))
        return {"step": self.step, "out": str(self.out / "adapter"), **self.lineage()}
