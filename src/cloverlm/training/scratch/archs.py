"""Architectures: the parts of training that depend on the model, behind one Arch protocol (build,
load, save, the step's loss, metrics); everything else in train.py is shared. Clover trains by block
diffusion; the same-size autoregressive peer (convert/peer.py) by next-token prediction on the same tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from cloverlm.convert import peer
from cloverlm.convert.load import load_model
from cloverlm.model.checkpoint import read_config, save_model
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.config import CHUNK_SIZE, CloverConfig
from cloverlm.model.layout import block_partition
from cloverlm.training import distributed
from cloverlm.training.scratch.data import Batch
from cloverlm.training.scratch.diffusion import diffusion_loss, mask_blocks
from cloverlm.training.scratch.probes import copy_probe, heldout_elbo
from cloverlm.training.scratch.recipe import Stage, TrainConfig


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
            sizes, t_fixed = block_partition(cfg.seq_len - 1, stage.block_sizes, generator, chunk=CHUNK_SIZE), None
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
