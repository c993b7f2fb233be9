"""The frozen base as a training step multiplies it: no weight cast, no gradient that nobody keeps.

Two costs the step does not need, both exact to remove (models/README.md, "Training on the CPU"):
- Under bf16 autocast a frozen fp32 weight is cast again on every forward. The adapted linears hold
  their weights in the multiplied dtype instead (`frozen_linears_to`), and so does the output head
  (`token_rows_apart`): a 49152 x 576 cast took 81 ms, 16 times a step.
- peft's trainable token rows (Clover's mask token, on the tied embedding and output head) rebuild the
  whole weight matrix on every call (`index_copy`), so autograd makes the embedding's dense gradient and
  the head's full weight gradient, to keep one row of each. `token_rows_apart` looks the frozen rows up
  and writes the trained ones over them: the same values, and gradients only for those rows.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F


def frozen_linears_to(peft_model, dtype: torch.dtype) -> None:
    """The frozen base weights of the adapted linear layers in `dtype`, the one autocast multiplies them
    in: autocast then casts no weight on every forward (its copies took 0.9 s of a 10.9 s CPU step). The
    values are those autocast would have made, so the loss is unchanged; the adapter stays fp32."""
    for module in peft_model.modules():
        base = getattr(module, "base_layer", None)
        # LoRA layers only: the tied lm_head is wrapped too (the mask token's row) and shares the embedding
        if hasattr(module, "lora_A") and isinstance(base, torch.nn.Linear) and not base.weight.requires_grad:
            base.weight.data = base.weight.data.to(dtype)


def token_rows_apart(peft_model, head_dtype: torch.dtype) -> None:
    """Every trainable-token layer computes with the frozen weight plus its trained rows written over the
    output, and the output head multiplies a copy of its frozen weight in `head_dtype`. The embedding keeps
    its own dtype: its rows are looked up, not multiplied. Layers of another kind keep peft's forward."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    for module in peft_model.modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(module, TrainableTokensLayer) or not _plain(module, base):
            continue
        weight = base.weight.detach()
        if isinstance(base, torch.nn.Linear):
            weight = weight.to(head_dtype)
        module.forward = partial(_rows_forward, module, module.forward, weight)
    head = peft_model.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad:
        head.forward = partial(_linear, head.weight.detach().to(head_dtype))


def _plain(layer, base) -> bool:
    if isinstance(base, torch.nn.Embedding):
        return base.max_norm is None and layer._get_embed_scale() is None
    return type(base) is torch.nn.Linear and base.bias is None and not base.weight.requires_grad


def _linear(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _rows_forward(layer, peft_forward, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if layer.merged or layer.disable_adapters or len(layer.active_adapters) != 1:
        return peft_forward(x)
    (name,) = layer.active_adapters
    tokens, rows = layer.token_indices[name], layer.trainable_tokens_delta[name]
    if isinstance(layer.base_layer, torch.nn.Embedding):
        out = F.embedding(x, weight)
        for row, token in enumerate(tokens):
            out = torch.where((x == token).unsqueeze(-1), rows[row].to(out.dtype), out)
        return out
    out = F.linear(x, weight)
    return out.index_copy(-1, torch.tensor(tokens, device=out.device), F.linear(x, rows).to(out.dtype))
