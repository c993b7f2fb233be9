"""The Clover model: a hybrid stack of memory and block-causal attention layers with MoE feed-forwards.

Two ways to run the same weights:

* `forward(input_ids, noisy_input_ids, block_sizes)`: the parallel two-stream training pass. The clean
  stream x_0 writes history (memory state, conv tails, keys and values); the noisy stream x_t of each
  block reads the history of the blocks before it and attends within its own block.
* `decode(cache, commit_ids=..., step_ids=...)`: blocks against a `CloverCache`, as the decoder runs
  them. commit_ids is a clean block that is folded into the cache; step_ids only reads the history (a
  denoising step) and gives its logits. `prefill` commits a whole prompt in one parallel pass.

Both paths give the same noisy-stream logits (docs/design.md invariant 2, tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from cloverlm.errors import CloverError, check_token_ids
from cloverlm.model.attention import CloverAttention
from cloverlm.model.cache import CloverCache, DecodeBlock, LayerCache, joint_key_mask
from cloverlm.model.config import ATTENTION, MEMORY, CloverConfig
from cloverlm.model.layers import CloverExperts, CloverMLP, CloverRMSNorm, CloverSparseMoeBlock
from cloverlm.model.layout import BlockLayout, NoisyBlocks, validate_block_sizes
from cloverlm.model.memory import CloverMemoryMixer

# ----------------------------------------------------------------------------------------------
# The stack


class CloverDecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = CloverRMSNorm.of(config, config.hidden_size)
        if layer_type == MEMORY:
            self.linear_attn = CloverMemoryMixer(config)
        else:
            self.self_attn = CloverAttention(config)
        self.post_attention_layernorm = CloverRMSNorm.of(config, config.hidden_size)
        if config.mlp_type == "dense":
            self.mlp = CloverMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = CloverSparseMoeBlock(config)

    @property
    def mixer(self):
        return self.linear_attn if self.layer_type == MEMORY else self.self_attn

    def _feed_forward(self, h):
        out = self.mlp(self.post_attention_layernorm(h))
        if isinstance(out, tuple):
            return h + out[0], out[1]
        return h + out, h.new_zeros((), dtype=torch.float32)

    def forward_streams(self, h_noisy, h_clean, layout, positions, cache: LayerCache | None = None, noisy=None):
        norm = self.input_layernorm
        extra = {} if noisy is None else {"noisy": noisy}
        mix_noisy, mix_clean = self.mixer.forward_streams(
            None if h_noisy is None else norm(h_noisy), norm(h_clean), layout, positions, cache, **extra
        )
        if h_noisy is None:
            h, aux = self._feed_forward(h_clean + mix_clean)
            return None, h, aux
        length = h_noisy.shape[1]
        # One MoE call over both streams: routing is per token, so this equals two calls.
        h, aux = self._feed_forward(torch.cat([h_noisy + mix_noisy, h_clean + mix_clean], dim=1))
        return h[:, :length], h[:, length:], aux

    def forward_decode(self, parts: list[tuple[torch.Tensor, DecodeBlock]], cache: LayerCache, skip_commit_ffn: bool = False,
                       joint_mask: torch.Tensor | None = None):
        """The fused decoding step of one layer over (h [B, n, hidden], block) parts, the block to commit
        before the block to denoise: the clean block is folded into the cache first, then the next reads
        the updated history; one feed-forward call serves both (routing is per token), and the mixer's
        forward_commit_step runs both parts with one call of each projection (attention layers: one attention
        call over joint_mask, cache.joint_key_mask).
        Returns the parts' new hidden states (None for a commit when skip_commit_ffn: on the last layer
        nothing reads it)."""
        if len(parts) == 2:
            (h_commit, commit), (h_step, step) = parts
            norm = self.input_layernorm
            mixes = self.mixer.forward_commit_step(norm(h_commit), norm(h_step), commit, step, cache, joint_mask)
            mixed = [h + mix for (h, _), mix in zip(parts, mixes)]
        else:
            mixed = [h + self.mixer.forward_block(self.input_layernorm(h), block, cache) for h, block in parts]
        live = [i for i, (_, block) in enumerate(parts) if not (skip_commit_ffn and block.commit)]
        if not live:
            return [None] * len(parts)
        # only real positions go through the experts; padding keeps its hidden state
        padded = any(parts[i][1].padded for i in live)
        rows = [mixed[i][parts[i][1].valid] if padded else mixed[i].flatten(0, 1) for i in live]
        flat = self._feed_forward(torch.cat(rows)[None])[0][0]
        start, out = 0, [None] * len(parts)
        for i, part_rows in zip(live, rows):
            piece = flat[start : start + len(part_rows)]
            start += len(part_rows)
            if padded:
                mixed[i][parts[i][1].valid] = piece.to(mixed[i].dtype)
                out[i] = mixed[i]
            else:
                out[i] = piece.view_as(mixed[i])
        return out


# ----------------------------------------------------------------------------------------------
# transformers wrappers


class CloverPreTrainedModel(PreTrainedModel):
    config_class = CloverConfig
    config: CloverConfig
    base_model_prefix = "model"
    _no_split_modules = ["CloverDecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Conv1d):
            # centred kernel: start close to identity so early training sees the token itself
            module.weight.normal_(0.0, std)
            module.weight[:, 0, module.weight.shape[-1] // 2] += 1.0
        elif isinstance(module, CloverRMSNorm):
            module.weight.fill_(0.0 if module.zero_centered else 1.0)
        elif isinstance(module, CloverExperts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, CloverSparseMoeBlock):
            module.expert_bias.zero_()
        elif isinstance(module, CloverMemoryMixer):
            # Per-token decay a = exp(-exp(A_log) * softplus(dt_bias)) spread geometrically over
            # memory_decay_range across heads: slow heads keep a long prompt (docs/design.md section 2b).
            lo, hi = self.config.memory_decay_range
            heads = module.A_log.shape[0]
            rates = torch.logspace(math.log10(-math.log(hi)), math.log10(-math.log(lo)), heads)
            module.dt_bias.fill_(0.5413248546129181)  # softplus(x) = 1
            module.A_log.copy_(rates.log())
            if not module.delta_mixing:
                module.attn_log_temperature.zero_()


class DecodeOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, ns, V]
    hidden: torch.Tensor | None  # [B, ns, H], normed


@dataclass
class CloverOutput(ModelOutput):
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    clean_logits: torch.Tensor | None = None


class CloverModel(CloverPreTrainedModel):
    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CloverDecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = CloverRMSNorm.of(config, config.hidden_size)
        self.post_init()


class CloverForBlockDiffusion(CloverPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CloverConfig):
        super().__init__(config)
        self.model = CloverModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def _check_ids(self, ids):
        if ids.numel() == 0:
            raise CloverError("empty input: at least one token is needed")
        check_token_ids((int(ids.min()), int(ids.max())), self.config.vocab_size)  # the extremes: two host syncs

    def forward(
        self, input_ids, noisy_input_ids=None, block_sizes=None, logits_mask=None, noisy_blocks: NoisyBlocks | None = None,
        clean_logits_mask=None,
    ) -> CloverOutput:
        """Two-stream training pass over the clean stream input_ids = x_0 [B, L] and a noisy stream:
        either noisy_input_ids = x_t [B, L], one noisy copy of every block, or `noisy_blocks`, noisy
        copies of chosen blocks only (all-attention stacks; the prompt is then computed once).

        block_sizes partitions L (default: one token per block). logits_mask (bool, the noisy stream's
        shape) limits the vocabulary projection to the positions that are scored; logits are then [M, V].
        clean_logits_mask [B, L] adds the clean stream's logits at those positions (clean_logits).
        """
        self._check_ids(input_ids)
        length = input_ids.shape[1]
        if noisy_blocks is not None:
            if any(kind == MEMORY for kind in self.config.layer_types):
                raise CloverError("noisy_blocks needs an all-attention stack; give noisy_input_ids for memory layers")
            noisy_input_ids = noisy_blocks.input_ids
            self._check_ids(noisy_input_ids)
        elif noisy_input_ids is None:
            noisy_input_ids = input_ids
        elif noisy_input_ids.shape != input_ids.shape:
            raise CloverError(f"noisy_input_ids {tuple(noisy_input_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        block_sizes = list(block_sizes) if block_sizes is not None else [1] * length
        validate_block_sizes(block_sizes, length, self.config.max_block_size)
        layout = BlockLayout.build(block_sizes, self.config.max_block_size, input_ids.device)
        positions = torch.arange(length, device=input_ids.device)
        embed = self.model.embed_tokens
        h_noisy, h_clean = embed(noisy_input_ids), embed(input_ids)
        aux_total = h_noisy.new_zeros((), dtype=torch.float32)
        for layer in self.model.layers:
            h_noisy, h_clean, aux = layer.forward_streams(h_noisy, h_clean, layout, positions, noisy=noisy_blocks)
            aux_total = aux_total + aux
        hidden = self.model.norm(h_noisy)
        if logits_mask is not None:
            hidden = hidden[logits_mask]
        clean_logits = None
        if clean_logits_mask is not None:
            clean_logits = self.lm_head(self.model.norm(h_clean[clean_logits_mask]))
        return CloverOutput(logits=self.lm_head(hidden), hidden_states=hidden, aux_loss=aux_total, clean_logits=clean_logits)

    def prefill(self, input_ids, block_sizes: list[int], cache: CloverCache) -> torch.Tensor:
        """Commit a whole prompt as clean blocks in one parallel pass (same result as block-by-block commits).

        Returns the final (normed) hidden state of the last prompt token [B, hidden]."""
        self._check_ids(input_ids)
        if bool(cache.lengths.any()):
            raise CloverError("prefill needs an empty cache; commit further blocks with decode")
        batch, length = input_ids.shape
        if batch != cache.batch_size:
            raise CloverError(f"a prompt batch of {batch} rows against a cache of {cache.batch_size}")
        validate_block_sizes(block_sizes, length, self.config.max_block_size)
        layout = BlockLayout.build(block_sizes, self.config.max_block_size, input_ids.device)
        positions = torch.arange(length, device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            _, h, _ = layer.forward_streams(None, h, layout, positions, layer_cache)
        cache.lengths = torch.full_like(cache.lengths, length)
        return self.model.norm(h[:, -1])

    def decode(
        self, cache: CloverCache, commit_ids=None, commit_valid=None, step_ids=None, step_valid=None, step_causal=None,
    ) -> DecodeOutput:
        """One decoding forward for a batch of rows: commit a clean block and/or run a denoising step.

        commit_ids [B, nc] are folded into the cache (row b: its first commit_valid[b].sum() tokens), then
        step_ids [B, ns] read the updated history without writing it. Both in one pass: at every layer the
        clean block updates the cache before the new block reads it (docs/design.md section 4). Returns the step's
        logits [B, ns, V] and final normed hidden states [B, ns, H] (both None without a step).
        step_causal [B, ns] bool marks step inputs that only the positions at and after them see (drafts).
        """
        if commit_ids is None and step_ids is None:
            raise CloverError("decode needs a block to commit or a block to denoise")
        parts = []
        history = cache.lengths
        for ids, valid, commit in ((commit_ids, commit_valid, True), (step_ids, step_valid, False)):
            if ids is None:
                continue
            self._check_ids(ids)
            if ids.shape[0] != cache.batch_size:
                raise CloverError(f"a block batch of {ids.shape[0]} rows against a cache of {cache.batch_size}")
            if ids.shape[1] > self.config.max_block_size:
                raise CloverError(f"block size {ids.shape[1]} is above the model's limit of {self.config.max_block_size}")
            valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid
            block = DecodeBlock.of(valid, history, commit, self.config.causal_clean_stream, None if commit else step_causal)
            parts.append((self.model.embed_tokens(ids), block))
            if commit:  # the block to denoise reads the history with the committed block in it
                history = history + valid.sum(1)
        layers = self.model.layers
        joint = len(parts) == 2 and ATTENTION in self.config.layer_types
        joint_mask = joint_key_mask(parts[0][1], parts[1][1]) if joint else None
        for index, (layer, layer_cache) in enumerate(zip(layers, cache.layers)):
            hidden = layer.forward_decode(parts, layer_cache, index == len(layers) - 1, joint_mask)
            parts = [(h, block) for h, (_, block) in zip(hidden, parts)]
        cache.lengths = history
        if step_ids is None:
            return DecodeOutput(None, None)
        hidden = self.model.norm(parts[-1][0])
        return DecodeOutput(self.lm_head(hidden), hidden)

    def moe_blocks(self) -> list[CloverSparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, CloverSparseMoeBlock)]

    def update_router_bias(self) -> None:
        for block in self.moe_blocks():
            block.update_bias(self.config.router_bias_update_rate)


def register_auto_classes() -> None:
    from transformers import AutoConfig, AutoModel

    AutoConfig.register("clover", CloverConfig, exist_ok=True)
    AutoModel.register(CloverConfig, CloverForBlockDiffusion, exist_ok=True)
