"""The autoregressive peer: transformers' own Qwen3.5-MoE text model, laid out like a Clover config.

Clover's hybrid stack (Gated DeltaNet memory layers, 1 in 4 attention, routed + shared experts) is
Qwen3.5-MoE's, so the same-size next-token model is a field-by-field copy of a CloverConfig. The peer
trains with the same trainer and data (`clover train --arch qwen3.5-moe`), scored on the same
positions, so the comparison isolates block diffusion against left-to-right decoding.

`peer_generate` decodes free with transformers' generate; `peer_generate_constrained` decodes under the
engine's grammar constraint, with forced tokens fed in one forward (jump-forward).

On CPU transformers runs the peer on its pure-PyTorch fallbacks (chunked gated delta rule, causal
conv1d). flash-linear-attention must not be installed there: it imports, then breaks those fallbacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from cloverlm.convert.adapter import adapter_objective, load_adapted
from cloverlm.errors import CloverError, check_token_ids
from cloverlm.model.checkpoint import (
    checked_weights,
    load_weights,
    read_config,
    save_model,
    stored_model_type,
)
from cloverlm.model.config import CloverConfig

if TYPE_CHECKING:  # the type only: convert comes before decoding in the package's one-way flow
    from cloverlm.decoding.params import Constraint

PEER_ARCH = "qwen3.5-moe"  # the name `clover train --arch` takes

# CloverConfig names these fields after Qwen3.5-MoE's, so they carry over unchanged.
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "initializer_range",
    "max_position_embeddings",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
    "tie_word_embeddings",
    "pad_token_id",
    "eos_token_id",
    "bos_token_id",
)


def peer_config(clover_config: CloverConfig, **overrides) -> Qwen3_5MoeTextConfig:
    """The Qwen3.5-MoE text config of the same size and layer pattern as `clover_config`.

    Rotary positions keep Qwen3.5's own partial rotary factor; only the base carries over.
    """
    fields = {name: getattr(clover_config, name) for name in SHARED_FIELDS}
    fields["layer_types"] = list(clover_config.layer_types)  # already stored with Qwen3.5's names
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": clover_config.rope_theta}
    return Qwen3_5MoeTextConfig(**{**fields, **overrides})


def build_peer(config: Qwen3_5MoeTextConfig) -> Qwen3_5MoeForCausalLM:
    """A randomly initialised peer (seed torch beforehand for a reproducible start)."""
    return Qwen3_5MoeForCausalLM(config)


def is_peer_folder(folder: str | Path) -> bool:
    """Whether the folder holds a peer: config.json naming the peer's model type, or the autoregressive
    adapter of a converted base (False otherwise: Clover's loader explains)."""
    if adapter_objective(folder) == "ar":
        return True
    return (Path(folder) / "config.json").is_file() and stored_model_type(folder) == Qwen3_5MoeTextConfig.model_type


def load_peer(folder: str | Path, dtype: torch.dtype | None = torch.float32) -> Qwen3_5MoeForCausalLM:
    """Load a peer model folder, with the same one-line errors (pickles, corrupt files) as Clover's; an
    autoregressive adapter folder is its base plus the adapter, merged (a transformers causal LM)."""
    if adapter_objective(folder) == "ar":
        return load_adapted(folder, dtype or torch.float32)[0]
    weights = checked_weights(folder)
    model = build_peer(read_config(Qwen3_5MoeTextConfig, folder))
    load_weights(model, weights)
    return model.to(dtype).eval() if dtype is not None else model.eval()


def save_peer(model: Qwen3_5MoeForCausalLM, tokenizer, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """config.json + model.safetensors + tokenizer files: Clover's folder layout."""
    save_model(model, tokenizer, Path(folder), dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Objective and evaluation


def next_token_loss(model: Qwen3_5MoeForCausalLM, input_ids: torch.Tensor, eligible: torch.Tensor):
    """Returns (mean NLL, router aux loss, accuracy) over the positions i with eligible[:, i], each
    predicted from tokens < i: the tokens Clover scores at block size 1 (position 0 has no history).
    """
    scored = eligible[:, 1:]
    predicting = F.pad(scored, (0, 1))  # position i - 1 predicts token i
    # logits only where they are scored: with a chat prompt that is a small share of the row
    out = model(input_ids, logits_to_keep=predicting, output_router_logits=True, use_cache=False)
    targets = input_ids[:, 1:][scored]
    nll = F.cross_entropy(out.logits.float(), targets, reduction="sum") / scored.sum().clamp(min=1)
    accuracy = (out.logits.argmax(-1) == targets).float().mean() if targets.numel() else nll.new_zeros(())
    return nll, out.aux_loss, accuracy.detach()


@torch.no_grad()
def heldout_nll(model: Qwen3_5MoeForCausalLM, windows: torch.Tensor) -> float:
    """Next-token NLL per token on held-out windows (the peer's elbo_b1)."""
    return float(next_token_loss(model, windows, torch.ones_like(windows, dtype=torch.bool))[0])


@torch.no_grad()
def copy_accuracy(model: Qwen3_5MoeForCausalLM, examples) -> float:
    """Teacher-forced greedy accuracy on the value tokens of task answers (Clover's copy probe at block 1)."""
    correct = total = 0
    for example in examples:
        if not example.value_positions:
            continue
        ids = torch.tensor([example.ids])
        values = torch.tensor(example.value_positions)
        logits = model(ids, use_cache=False).logits[0, values - 1]
        correct += int((logits.argmax(-1) == ids[0, values]).sum())
        total += len(values)
    return correct / max(total, 1)


# ----------------------------------------------------------------------------------------------
# Decoding


def _check_request(model, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise CloverError("empty prompt: at least one token is needed")
    if max_new_tokens < 1:
        raise CloverError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    check_token_ids(prompt_ids, model.config.vocab_size)


@torch.no_grad()
def peer_generate(
    model: Qwen3_5MoeForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int = 256,
    stop_ids: tuple[int, ...] = (),
    prompt_lookup: int = 0,
) -> list[int]:
    """Greedy decoding with transformers' generate and its cache; the new tokens, cut before the first stop id.
    prompt_lookup > 0 drafts that many tokens from the prompt's n-gram matches (transformers'
    prompt_lookup_num_tokens): the same greedy tokens, fewer forwards on extraction."""
    _check_request(model, prompt_ids, max_new_tokens)
    if prompt_lookup < 0:
        raise CloverError(f"prompt_lookup must be 0 (off) or a number of draft tokens, got {prompt_lookup}")
    lookup = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    ids = torch.tensor([prompt_ids])
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        # An explicit list, even empty: None would fall back to the config's eos, and Clover's
        # decoder stops only where it is told to.
        eos_token_id=list(stop_ids),
        pad_token_id=model.config.pad_token_id,
        **lookup,
    )
    new_tokens = output[0, len(prompt_ids) :].tolist()
    stops = set(stop_ids)
    end = next((i for i, token in enumerate(new_tokens) if token in stops), len(new_tokens))
    return new_tokens[:end]


class ConstrainedOutput(NamedTuple):
    tokens: list[int]  # the new tokens, cut before the stop
    forwards: int  # calls of the model, the first of them reading the prompt
    forced: int  # tokens the grammar fixed, taken without a choice of the model


class _CachedReader:
    """The peer's cache (attention keys and values; for Qwen3.5's linear layers their state) and how many
    forwards have filled it."""

    def __init__(self, model):
        self.model, self.cache, self.forwards = model, DynamicCache(config=model.config), 0

    def read(self, ids: list[int]) -> torch.Tensor:
        """Append `ids` to the cache in one forward; the logits after the last of them."""
        input_ids = torch.tensor([ids], device=self.model.device)
        logits = self.model(input_ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits
        self.forwards += 1
        return logits[0, -1].float().cpu()


@torch.no_grad()
def peer_generate_constrained(
    model,
    prompt_ids: list[int],
    constraint: Constraint,
    max_new_tokens: int = 256,
    stop_ids: tuple[int, ...] = (),
    jump_forward: bool = True,
) -> ConstrainedOutput:
    """Greedy decoding under a grammar: a `decoding.grammar.GrammarConstraint` (`Grammars.constraint`), the
    constraint the engine decodes Clover under.

    At a choice the grammar's mask is applied to the logits. Where the grammar fixes what comes next, the
    tokens are taken without the model: its forced run (`constraint.forced()`, what the engine writes into
    a block for free) or else the one token its mask allows; greedy would take the same. With
    jump_forward every token the model has not read yet (the prompt, the last choice and the forced run
    after it) goes into ONE forward on the KV cache, right before the next choice, as SGLang's
    jump-forward decoding does; without, one forward per token (the plain baseline: the same tokens).
    A grammar that has finished allows only its end tokens, which must be among `stop_ids`: the answer
    ends there without a forward.
    """
    _check_request(model, prompt_ids, max_new_tokens)
    if not stop_ids:
        raise CloverError("constrained decoding needs stop_ids: the tokens a finished grammar ends on")
    stops = sorted(set(stop_ids))
    constraint.limit(max_new_tokens)
    reader = _CachedReader(model)
    unread = [list(prompt_ids)]  # what the model has not read, one entry per forward of the plain path
    tokens: list[int] = []
    forced = 0
    while len(tokens) < max_new_tokens:
        run = constraint.forced()
        if not run:
            # what the grammar fixes, not the budget: near its end the budget narrows the mask to a short
            # ending's next token, which is the model's to choose or not (a date cut to "202" otherwise)
            allowed = constraint.allowed(within_budget=False)
            going_on = allowed.clone()
            going_on[stops] = False
            if not going_on.any():
                break  # only an end token may follow: the answer is complete
            if int(going_on.sum()) == 1 and not allowed[stops].any():
                run = going_on.nonzero()[0].tolist()
        if run:
            run = run[: max_new_tokens - len(tokens)]
            for token in run:
                constraint.advance(token)
            tokens += run
            forced += len(run)
            unread += [[token] for token in run]
            continue
        for ids in [[t for piece in unread for t in piece]] if jump_forward else unread:
            logits = reader.read(ids)
        unread = []
        if logits.numel() != allowed.numel():
            raise CloverError(f"the grammar has {allowed.numel()} tokens, the model {logits.numel()}")
        token = int(logits.argmax())  # as the engine does: the mask only where the model's choice is refused
        if not constraint.allows(token):
            token = int(logits.masked_fill(~constraint.allowed(scores=logits), float("-inf")).argmax())
        if token in stops:
            break
        constraint.advance(token)
        tokens.append(token)
        unread = [[token]]
    return ConstrainedOutput(tokens, reader.forwards, forced)
