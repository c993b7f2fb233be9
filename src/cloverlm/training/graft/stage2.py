"""Stage 2 of the memory graft (issue 30, item 4): the whole hybrid trained on logit KL against the
all-attention model it was grafted from (`clover train --recipe graft-stage2`).

Stage 1 fits each memory layer to its attention on the teacher's own input; the errors of the layers then
pile up along the stack. Here the student runs end to end and its grafted mixers (the only trained part, as
in stage 1: base.py) are fitted so that its predictions match the teacher's: the second stage of "Distilling
to Hybrid Attention Models via KL-Guided Layer Selection" and of LoLCATs, on Clover's own objective.

Choices:
- what is compared: the predictions of the noisy stream, the ones the engine decodes from. Rows are packed
  as in stage 1, cut into blocks of the conversion trainer's sizes, and each block's targets masked with
  its own probability t ~ U(0, 1) (scratch/diffusion.py's mask_blocks: the block-diffusion objective's rule).
  The aligned two-stream form, one noisy copy of every block: the packed noisy copies of the conversion
  trainer need an all-attention stack. Not the clean stream's next-token logits: a memory layer sees its
  whole block in both directions (it ignores `causal_clean_stream`), so in the clean stream the student would
  read the token it is asked to predict. A noisy block sees only the clean blocks before it and itself, in
  the teacher and the student alike.
- loss: KL(teacher || student) at each scored slot (the masked targets and each block's last), summed over
  the vocabulary, averaged over the step's slots, so that one row at a time (the CPU's micro-batches) gives
  the batch's gradients. Logged beside it: how often the student's argmax is the teacher's (`agree`).
  data_weight > 0 adds the conversion objective's own term (issue 30, item 4: "then the conversion
  objective"): the cross-entropy of the text's tokens at the same slots, averaged alike, so that the hybrid
  can learn past its teacher where the teacher is wrong (`data_nll` in the log).
- dtype: as in base.py (the teacher in bf16 and the student under bf16 autocast where the hardware multiplies
  it; the trained mixers and their optimizer in fp32).
- no held-out evaluation: every batch is new data, so each step's KL is measured before any update on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cloverlm.training.graft.base import GraftLoop, GraftStageConfig, plot_log
from cloverlm.training.scratch.diffusion import NoisedBatch, mask_blocks

PLOT_FILE = "stage2_kl.png"


@dataclass
class Stage2Config(GraftStageConfig):
    out: str = "runs/graft-stage2"
    lr: float = 3e-4  # the mixers start where stage 1 left them
    warmup_steps: int = 10
    data_weight: float = 0.0  # the text's own cross-entropy beside the KL (0: distillation alone)


def distillation_kl(
    student, teacher, noised: NoisedBatch, block_sizes: list[int], slots: int, data_weight: float = 0.0
) -> tuple[torch.Tensor, dict]:
    """(KL(teacher || student) summed over the scored slots of `noised` and divided by `slots`, plus
    data_weight times the cross-entropy of the slots' targets averaged alike; stats) for two Clover models;
    `slots` is the whole step's count where `noised` is a part of it."""
    device = next(student.parameters()).device
    inputs = (noised.clean_ids.to(device), noised.noisy_ids.to(device), block_sizes)
    scored = noised.scored.to(device)
    with torch.no_grad():
        target = teacher(*inputs, logits_mask=scored).logits.float().log_softmax(-1)
    predicted = student(*inputs, logits_mask=scored).logits.float().log_softmax(-1)
    kl = (target.exp() * (target - predicted)).sum(-1).sum() / max(slots, 1)
    agree = (predicted.argmax(-1) == target.argmax(-1)).float().sum() / max(slots, 1)
    stats = {"kl": float(kl.detach()), "agree": float(agree), "tokens": 2 * noised.clean_ids.numel()}
    if not data_weight:
        return kl, stats
    nll = -predicted.gather(-1, noised.targets.to(device)[scored][:, None]).sum() / max(slots, 1)
    return kl + data_weight * nll, stats | {"data_nll": float(nll.detach())}


class GraftStage2(GraftLoop):
    label = "graft stage 2"
    plot_file = PLOT_FILE
    recipe = "graft-stage2"

    def batch(self, step: int) -> tuple[NoisedBatch, list[int]]:
        """(the noised rows, the step's block partition): seq_len + 1 tokens a row give seq_len input positions."""
        ids = self.rows(step, self.cfg.seq_len + 1)
        partition, generator = self.partition(step)
        eligible = torch.ones_like(ids, dtype=torch.bool)
        return mask_blocks(ids, eligible, partition, self.data.mask_id, generator), partition

    def micro_batches(self, batch) -> list:
        """One row at a time (half the peak memory; the same gradients): (row, partition, the step's slots)."""
        noised, partition = batch
        slots = int(noised.scored.sum())
        return [(noised.rows([r]), partition, slots) for r in range(noised.clean_ids.shape[0])]

    def loss(self, part, step: int):
        noised, partition, slots = part
        return distillation_kl(self.student, self.teacher, noised, partition, slots, self.cfg.data_weight)

    def merge(self, outs: list[dict]) -> dict:
        return {key: sum(out[key] for out in outs) for key in outs[0]}  # each row's share of the batch's

    def after_step(self, batch, total, stats) -> dict:
        self.state["tokens"] += stats["tokens"]
        return {"loss": float(total), **{key: round(value, 5) for key, value in stats.items()}}

    def postfix(self, record: dict) -> dict:
        return {"kl": f"{record['kl']:.4f}", "agree": f"{record['agree']:.3f}"}

    def plot(self, png_path: Path) -> None:
        plot_log(self.log_path, png_path, "kl", "KL(teacher || student) per noisy slot",
                 "Graft stage 2: the hybrid against the all-attention model")  # fmt: skip
