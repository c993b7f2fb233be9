"""The block-size head behind `block_size="auto"` (docs/design.md section 5).

A small head reads the hidden state a block starts from (the final hidden state of the last decoded
position) and predicts, for each candidate size n, how many denoising steps the next block would take
at the calibrated threshold. The decoder picks the size with the highest expected tokens per second,
n / (steps(n) * ms(n)), where ms is what a step of that size cost while the calibrating machine decoded
(forward and host work, `step_ms`; a bare forward, `forward_ms`, for older calibrations), grown with the
block's history as the bare forward grows (`ms_per_1k_context`): a bigger block only pays when the model
is sure enough to fill it in few steps. Under a grammar forced runs fill part
of every block for free, which changes the size that pays, and the hidden state cannot tell whether a
request is constrained: such requests get their own head (`constrained`, fitted on answers decoded
under schemas, plain and grounded), where one was fitted. `clover calibrate`
(cloverlm.training.calibrate) fits it and saves calibration.json + calibration.safetensors into the
model folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FILES = ("calibration.json", "calibration.safetensors")


@dataclass
class Calibration:
    block_sizes: list[int]
    threshold: float
    forward_ms: list[float]  # one denoising forward of each size, batch 1
    weight: torch.Tensor  # [S, H]: log(steps) = weight @ hidden + bias
    bias: torch.Tensor  # [S]
    prefill_block_size: int = 16
    constrained: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, bias) for requests under a grammar
    # What a denoising step of each size cost in decoding, per kind of request ("free", "constrained"): the
    # forward, the commit it carries and the host's unmasking and grammar. Where given, the choice divides
    # by these rather than by forward_ms, a bare forward that leaves out the host's fixed cost per step.
    step_ms: dict[str, list[float]] | None = None
    # The context (tokens before the block) forward_ms and step_ms were measured at, and what a forward of
    # each size adds per 1,000 tokens more of it (two bare forwards, at forward_context and at a long one).
    # Attention makes a step's cost grow with the history, and faster for the larger sizes, so the size that
    # pays behind a 2,000-token prompt is not the one that pays behind the calibration prompts.
    forward_context: int | None = None
    ms_per_1k_context: list[float] | None = None

    def predicted_steps(self, hidden: torch.Tensor, constrained: bool = False) -> torch.Tensor:
        weight, bias = self.constrained if constrained and self.constrained is not None else (self.weight, self.bias)
        steps = (weight @ hidden.float() + bias).exp()
        return torch.minimum(steps.clamp(min=1.0), torch.tensor(self.block_sizes, dtype=torch.float32))

    def choose(self, hidden: torch.Tensor, constrained: bool = False, context: int | None = None) -> int:
        """The size with the most tokens per second for a block behind `context` tokens of history."""
        sizes = torch.tensor(self.block_sizes, dtype=torch.float32)
        speed = sizes / (self.predicted_steps(hidden, constrained) * torch.tensor(self.cost_ms(constrained, context)))
        return self.block_sizes[int(speed.argmax())]

    def cost_ms(self, constrained: bool = False, context: int | None = None) -> list[float]:
        """Milliseconds a step of each size costs requests of this kind, behind `context` tokens (None: at
        the context it was measured at). Linear in the context; never below a quarter of the measured cost,
        so that a steep slope cannot make a short context's step free."""
        kind = "constrained" if constrained else "free"
        measured = self.step_ms[kind] if self.step_ms and kind in self.step_ms else self.forward_ms
        if context is None or self.ms_per_1k_context is None or self.forward_context is None:
            return measured
        grown = (context - self.forward_context) / 1000
        return [max(ms + slope * grown, ms / 4) for ms, slope in zip(measured, self.ms_per_1k_context)]

    def save(self, folder: Path, extra: dict | None = None) -> None:
        folder = Path(folder)
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        if self.constrained is not None:
            tensors |= {"constrained_weight": self.constrained[0].contiguous(), "constrained_bias": self.constrained[1].contiguous()}
        save_file(tensors, str(folder / FILES[1]))
        own = {
            "block_sizes": self.block_sizes,
            "threshold": self.threshold,
            "forward_ms": self.forward_ms,
            "prefill_block_size": self.prefill_block_size,
            "step_ms": self.step_ms,
            "forward_context": self.forward_context,
            "ms_per_1k_context": self.ms_per_1k_context,
        }
        # the calibration's own fields win over a report's keys of the same name (an older file's, kept)
        meta = {**(extra or {}), **{key: value for key, value in own.items() if value is not None}}
        (folder / FILES[0]).write_text(json.dumps(meta, indent=1))


def load_calibration(folder: str | Path) -> Calibration | None:
    """The calibration saved in a model folder, or None if it was never calibrated."""
    folder = Path(folder)
    if not (folder / FILES[0]).exists():
        return None
    meta = json.loads((folder / FILES[0]).read_text())
    tensors = load_file(str(folder / FILES[1]))
    return Calibration(
        block_sizes=meta["block_sizes"],
        threshold=meta["threshold"],
        forward_ms=meta["forward_ms"],
        weight=tensors["weight"],
        bias=tensors["bias"],
        prefill_block_size=meta.get("prefill_block_size", 16),
        step_ms=meta.get("step_ms"),
        forward_context=meta.get("forward_context"),
        ms_per_1k_context=meta.get("ms_per_1k_context"),
        constrained=(tensors["constrained_weight"], tensors["constrained_bias"]) if "constrained_weight" in tensors else None,
    )
