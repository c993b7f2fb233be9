"""Stage 1 of the memory graft (issue 30): every grafted memory layer trained, layer by layer, to do what the
attention layer it replaced did (`clover train --recipe graft-stage1`).

The student is a grafted folder (convert/graft.py: `clover convert --graft memory`), the teacher the
all-attention model it was grafted from. Each step runs the teacher once, without gradients, over packed rows
of the conversion trainer's task mixture, and keeps every grafted layer's attention input (the output of
`input_layernorm`) and output (the output of `o_proj`). Each grafted mixer then reads its own layer's teacher
input and is fitted to that layer's teacher output. This is the first stage of "Distilling to Hybrid Attention
Models via KL-Guided Layer Selection" (each layer's output aligned to its attention's, short sequences) and of
LoLCATs (the new parts trained to match the softmax outputs). It is layer-local: no gradient crosses the
stack, so the student's other layers never run. That makes it the cheapest training this CPU can do. Stage 2
(the whole hybrid on logit KL) then fixes the errors that the layers pile up on one another.

Choices:
- loss: per layer, mean_t |mixer(x)_t - y_t|^2 / mean_t |y_t|^2 (a normalised MSE: 1.0 for a silent layer,
  0 for an exact one), averaged over the layers. The layers' outputs differ in size by orders of magnitude
  along the stack. A plain MSE would let the loudest layers fill the shared gradient clip and the log.
  Normalised, every layer counts alike and the curves compare across layers and models. Adam does not see the
  scale of the mean over layers, only the clip does.
- block sizes: the clean stream runs on blocks drawn from the conversion trainer's sizes
  (CONVERT_BLOCK_SIZES, one partition per step), the sizes the model decodes and commits in. A memory layer
  sees its own block bidirectionally and the blocks before it through its state (memory layers ignore
  `causal_clean_stream`). With block size 1, the in-block attention and the fusion gate would learn nothing.
  The teacher runs causally (block size 1, as in `teacher_layers`; with causal_clean_stream the block sizes
  do not change its output).
- teacher, student, the trained mixers, checkpoints and --resume: base.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cloverlm.convert.graft import teacher_layers
from cloverlm.model.layout import BlockLayout
from cloverlm.training.graft.base import GraftLoop, GraftStageConfig, plot_log

PLOT_FILE = "stage1_loss.png"


@dataclass
class Stage1Config(GraftStageConfig):
    out: str = "runs/graft-stage1"


class GraftStage1(GraftLoop):
    label = "graft stage 1"
    plot_file = PLOT_FILE
    recipe = "graft-stage1"

    def batch(self, step: int):
        """(ids [rows, seq_len], the step's block partition)."""
        return self.rows(step, self.cfg.seq_len), self.partition(step)[0]

    def micro_batches(self, batch) -> list:
        """The one teacher forward of the step, then one part per grafted layer: (layer, its teacher input,
        its teacher output, layout, positions). Each layer goes forward and backward on its own, so that only
        one layer's activations are alive at a time."""
        ids, partition = batch
        captured = teacher_layers(self.teacher, self.layers, ids)
        layout = BlockLayout.build(partition, self.student.config.max_block_size, self.device)
        positions = torch.arange(ids.shape[1], device=self.device)
        return [(i, x.float(), y.float(), layout, positions) for i, (x, y) in captured.items()]

    def loss(self, part, step: int):
        layer, x, y, layout, positions = part
        out = self.model[str(layer)].forward_streams(None, x, layout, positions)[1]
        error = (out.float() - y).pow(2).sum(-1).mean() / y.pow(2).sum(-1).mean()
        return error / len(self.layers), {str(layer): float(error.detach())}

    def merge(self, outs: list[dict]) -> dict:
        return {layer: value for out in outs for layer, value in out.items()}

    def after_step(self, batch, total, layer_loss) -> dict:
        tokens = batch[0].numel()
        self.state["tokens"] += tokens
        rounded = {layer: round(value, 5) for layer, value in layer_loss.items()}
        return {"loss": float(total), "layer_loss": rounded, "tokens": tokens}

    def postfix(self, record: dict) -> dict:
        return {"loss": f"{record['loss']:.4f}"}

    def plot(self, png_path: Path) -> None:
        plot_log(self.log_path, png_path, "layer_loss", "|mixer - attention|² / |attention|²",
                 "Graft stage 1: each memory layer against its attention")  # fmt: skip
