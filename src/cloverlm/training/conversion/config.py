"""The conversion trainer's configuration, apart from the trainer so that its data (data.py) and the
distillation (distill.py) read it without importing the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from cloverlm.convert.base import DEFAULT_BASE

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
    # no_fly distractors drawn more often, {text in a template: weight} (tasks.no_fly_zones.compose)
    distractor_weights: dict[str, float] = field(default_factory=dict)
    tokens_per_step: int = 1600  # clean tokens packed into each row
    rows_per_step: int = 1
    lr: float = 5e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    lora_rank: int = 32
    lora_alpha: int = 64
    max_steps: int = 400
    minutes: float | None = None
    eval_every: int = 50
    checkpoint_every: int = 10
    device: str = "auto"  # auto: cuda when available
    # bf16 autocast, the frozen base's linear weights stored in bf16; None: where the hardware multiplies
    # bf16 (checkpoint.multiplies_bf16). On an AVX2 CPU a bf16 step took 4x as long as fp32.
    bf16: bool | None = None
    # Rows are padded to a multiple of this (None: GPU_PAD_MULTIPLE on CUDA; on CPU padding only costs).
    pad_multiple: int | None = None
    compile: bool = False  # torch.compile the model (static shapes: worth it with padding on CUDA)
    chat_examples: int | None = 128  # the first N records of data/chat_distill/train.jsonl (None: all)
    init_adapter: str | None = None  # start from this adapter folder (fresh optimizer, warm-up again)
    distill_data: str | None = None  # trajectories (training/conversion/distill.py) for the mixture's "distill" source
    # masks drawn per answer block, each with its complementary copy: the noisy stream (what decoding in
    # parallel learns from) grows, the clean prompt it attends to is still computed once
    noisy_draws: int = 1
    certainty_weight: float = 0.0  # certainty forcing on right noisy predictions (objective.conversion_loss)
