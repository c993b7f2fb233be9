"""The graft: memory layers in place of chosen attention layers of a converted Llama-family model.

A converted base (convert/base.py) has only block-causal attention, whose cache grows with the context.
`graft_memory` replaces chosen layers by memory layers (docs/design.md section 2b: a restructured Gated
DeltaNet) and starts each one from the attention it replaces, as "Distilling to Hybrid Attention Models
via KL-Guided Layer Selection" and "Mamba in the Llama" do (without that start the conversion
collapses): q and o copied, k and v repeated from the KV heads to the query heads as GQA shares them.
The in-block attention reuses those q, k, v; the conv starts as the identity; decays spread over
`memory_decay_range` (slow heads keep a long prompt); beta, decay and fusion gates start at their
midpoints. Given a calibration batch, the in-block temperature matches the replaced softmax's measured
sharpness, the gated norm's silu(z) gate opens and the layer's output takes its attention's size.
Embeddings, norms, feed-forwards and the other layers are copied. The graft is only a start: the memory read-out, the gates
and the gated norm are learned by the layer-wise distillation that follows (issue 30, stage 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cloverlm.convert.base import clover_from_state
from cloverlm.errors import CloverError
from cloverlm.model.cache import CloverCache
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.config import ATTENTION, MEMORY, CloverConfig, default_layer_types
from cloverlm.model.layout import BlockLayout
from cloverlm.model.memory import CloverMemoryMixer

# z at the mean calibration input: silu(3) = 2.86, an open gate (measured: 1 and 6 do as well once the
# output scale is matched).
GATE_OPEN = 3.0


def default_memory_layers(num_layers: int) -> list[int]:
    """Three memory layers in four, attention kept at layers 3, 7, 11, ... (the config's default stack)."""
    return [i for i, kind in enumerate(default_layer_types(num_layers)) if kind == MEMORY]


def attention_layers(config: CloverConfig) -> list[int]:
    """The attention layers of a stack: what `--memory-layers all` grafts (the all-memory student of stage 1)."""
    return [i for i, kind in enumerate(config.layer_types) if kind == ATTENTION]


def grafted_config(config: CloverConfig, memory_layers: Sequence[int]) -> CloverConfig:
    """`config` with the chosen layers memory, their heads those of the attention they replace."""
    layers = _checked_layers(config, memory_layers)
    memory_geometry = dict(
        memory_block_mixing="attention",
        linear_num_key_heads=config.num_attention_heads,
        linear_num_value_heads=config.num_attention_heads,
        linear_key_head_dim=config.head_dim,
        linear_value_head_dim=config.head_dim,
    )
    if MEMORY in config.layer_types and any(getattr(config, k) != v for k, v in memory_geometry.items()):
        raise CloverError("the model's memory layers are not shaped as a graft's (heads and dims of its attention)")
    layer_types = [MEMORY if i in layers else kind for i, kind in enumerate(config.layer_types)]
    return CloverConfig(**{**config.to_dict(), **memory_geometry, "layer_types": layer_types})


def _checked_layers(config: CloverConfig, memory_layers: Sequence[int]) -> set[int]:
    if config.attention_qk_norm or config.attention_output_gate or config.partial_rotary_factor != 1:
        raise CloverError(
            "the graft needs a converted Llama-family model (attention without q/k norm, output gate or partial rotary)"
        )
    layers = _layer_indices(memory_layers, config.num_hidden_layers, "graft")
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if repeated:
        raise CloverError(f"memory layers {repeated} are given more than once")
    memory = [i for i in layers if config.layer_types[i] == MEMORY]
    if memory:
        raise CloverError(f"layers {memory} are memory layers already; only attention layers can be grafted")
    return set(layers)


def _layer_indices(layers: Sequence[int], count: int, verb: str) -> list[int]:
    """`layers` as a list, checked: at least one (a change of nothing is a mistake, e.g. an empty
    --memory-layers, not a copy), each an index of the model's `count` layers."""
    layers = list(layers)
    if not layers:
        raise CloverError(f"no layers to {verb}: give at least one layer index")
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad:
        raise CloverError(f"layers {bad} are out of range: the model has layers 0..{count - 1}")
    return layers


def check_graft_of(teacher: CloverForBlockDiffusion, student: CloverForBlockDiffusion) -> None:
    """CloverError unless `student` has `teacher`'s stack (layers and width), as a graft of it does."""
    t, s = teacher.config, student.config
    if (t.num_hidden_layers, t.hidden_size) != (s.num_hidden_layers, s.hidden_size):
        raise CloverError("the student is not a graft of the teacher (its layers or hidden size differ)")


def grafted_layers(teacher, student) -> list[int]:
    """The student's memory layers that are attention layers in the teacher: the layers the stages train."""
    check_graft_of(teacher, student)
    t, s = teacher.config, student.config
    layers = [
        i for i, (a, b) in enumerate(zip(t.layer_types, s.layer_types)) if a == ATTENTION and b == MEMORY
    ]
    if not layers:
        raise CloverError(
            "the student has no memory layer in place of a teacher's attention layer: nothing to train"
        )
    return layers


def _repeat_heads(weight: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """[kv_heads * D, h] -> [heads * D, h]: query head j reads KV head j // (heads // kv_heads), as GQA does."""
    return weight.unflatten(0, (kv_heads, -1)).repeat_interleave(heads // kv_heads, dim=0).flatten(0, 1)


@torch.no_grad()
def teacher_layers(model: CloverForBlockDiffusion, layers: Sequence[int], ids: torch.Tensor) -> dict[int, tuple]:
    """Each chosen layer's attention input (the normed hidden states) and output, [B, L, hidden] each, from
    one clean pass at block size 1: the base's causal forward (docs/design.md invariant 7)."""
    captured: dict[int, dict] = {i: {} for i in layers}

    def keep(i, key):
        return lambda module, args, out: captured[i].__setitem__(key, out.detach())

    hooks = []
    for i in layers:
        layer = model.model.layers[i]
        hooks += [layer.input_layernorm.register_forward_hook(keep(i, "x")), layer.self_attn.o_proj.register_forward_hook(keep(i, "y"))]
    try:
        batch, length = ids.shape
        model.prefill(ids.to(model.device), [1] * length, CloverCache.empty(model.config, batch, model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return {i: (found["x"], found["y"]) for i, found in captured.items()}


def _softmax_temperature(attention: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per query head, the mean of |q_i| |k_j| / sqrt(D) over token pairs of x [tokens, hidden]: how sharp the
    replaced softmax is (rotary turns q and k without changing their norms). The mean over pairs is the
    product of the two means."""
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    q = (x @ attention.q_proj.weight.float().T).unflatten(-1, (heads, -1)).norm(dim=-1).mean(0)
    k = (x @ attention.k_proj.weight.float().T).unflatten(-1, (kv_heads, -1)).norm(dim=-1).mean(0)
    return q * k.repeat_interleave(heads // kv_heads) / attention.head_dim**0.5


@torch.no_grad()
def _calibrate(mixer: CloverMemoryMixer, attention: nn.Module, x: torch.Tensor, y: torch.Tensor, max_block: int) -> None:
    """Fit the grafted mixer's temperature, output gate and output scale to its attention on input x and
    output y [B, L, hidden]."""
    flat = x.flatten(0, 1).float()
    # _temperature() = exp(attn_log_temperature) * sqrt(D) multiplies unit q . k: make it |q||k|/sqrt(D).
    sharpness = _softmax_temperature(attention, flat)
    mixer.attn_log_temperature.copy_((sharpness / mixer.head_k_dim**0.5).log())
    # The gated norm multiplies by silu(z) and in_proj_z has no bias, so z cannot be a constant. Every row
    # along the mean input makes z = GATE_OPEN * (x . mean) / |mean|^2: GATE_OPEN at the mean input, one
    # positive factor per token, equal across channels, so the gate keeps the read-out's direction.
    # Measured on SmolLM2-135M (23 layers grafted, 384 tokens): the layers' outputs have cosine 0.39 with
    # their attention's (0.49 at block size 16) against 0.00 for the normal init and 0.27 for z copied from v.
    mean = flat.mean(0)
    mixer.in_proj_z.weight.copy_((GATE_OPEN * mean / mean.pow(2).sum()).expand_as(mixer.in_proj_z.weight))
    # The per-head RMSNorm drops the read-out's scale: match the attention's mean output norm (a 10x
    # larger output otherwise, and a worse start of the whole model: KL to the source 5.0 against 9.5).
    length = x.shape[1]
    layout = BlockLayout.build([1] * length, max_block, x.device)
    out = mixer.forward_streams(None, x, layout, torch.arange(length, device=x.device))[1]
    target, got = y.float().norm(dim=-1).mean(), out.float().norm(dim=-1).mean()
    if target > 0 and got > 0:  # an attention that writes nothing (seen in tests) leaves the scale at 1
        mixer.norm.weight.mul_(target / got)


def _mixer_from_attention(attention: nn.Module, config: CloverConfig, weight: torch.Tensor) -> CloverMemoryMixer:
    """A memory mixer that reads with the attention's own projections (see the module docstring)."""
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    mixer = CloverMemoryMixer(config).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        mixer.in_proj_qkv.weight.copy_(
            torch.cat([
                attention.q_proj.weight,
                _repeat_heads(attention.k_proj.weight, kv_heads, heads),
                _repeat_heads(attention.v_proj.weight, kv_heads, heads),
            ])
        )  # fmt: skip
        mixer.out_proj.weight.copy_(attention.o_proj.weight)
        mixer.conv1d.weight.zero_()
        mixer.conv1d.weight[:, 0, config.conv_radius] = 1.0  # the centred identity: each token passes itself
        # sigmoid(0) and softplus(dt_bias): beta 0.5, the decay at its per-head start, memory and in-block
        # attention fused half and half; training moves each gate from its midpoint.
        for gate in (mixer.in_proj_b, mixer.in_proj_a, mixer.in_proj_lam):
            gate.weight.zero_()
        # The gated norm multiplies by silu(z): a zero in_proj_z would silence the layer. Without a
        # calibration the from-scratch normal init (small, sign-balanced); with one, `_calibrate` opens it.
        mixer.in_proj_z.weight.normal_(0.0, config.initializer_range)
    return mixer


def graft_memory(
    model: CloverForBlockDiffusion, memory_layers: Sequence[int], calibration: torch.Tensor | None = None
) -> CloverForBlockDiffusion:
    """A new model (`model` is left as it was) whose `memory_layers` are memory layers started from the
    attention they replace, in `model`'s dtype and device, in eval mode. memory_layers: indices of attention
    layers, at least one. calibration: token ids [B, L] on which each replaced attention is measured, to set
    the in-block temperature, the output gate and the output scale (`_calibrate`); without it
    attn_log_temperature = 0, the gate at the normal init and the gated norm at 1."""
    config = grafted_config(model.config, memory_layers)  # checks the layers
    layers = sorted(memory_layers)
    replaced = {f"model.layers.{i}.self_attn." for i in layers}
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith(tuple(replaced))}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's twin: tied again by clover_from_state
    weight = model.model.embed_tokens.weight
    for i in layers:
        mixer = _mixer_from_attention(model.model.layers[i].self_attn, config, weight)
        state.update({f"model.layers.{i}.linear_attn.{k}": v for k, v in mixer.state_dict().items()})
    graft = clover_from_state(config, state, "the graft")
    teacher = teacher_layers(model, layers, calibration) if calibration is not None else {}
    for i in layers:
        mixer = graft.model.layers[i].linear_attn
        # The model's own initialisation of a memory layer: decays log-spaced over memory_decay_range
        # (docs/design.md section 2b) and attn_log_temperature 0; one code path for both.
        graft._init_weights(mixer)
        if i in teacher:
            _calibrate(mixer, model.model.layers[i].self_attn, *teacher[i], config.max_block_size)
    return graft.eval()


def restore_attention(
    student: CloverForBlockDiffusion, teacher: CloverForBlockDiffusion, layers: Sequence[int]
) -> CloverForBlockDiffusion:
    """A new model (both inputs are left as they were): `student` with its memory layers `layers` turned
    back into the teacher's attention, its q/k/v/o copied from `teacher`; every other weight (the layer's
    norms and feed-forward included, which stage 2 may train) is the student's. The inverse of
    `graft_memory` for the mixers: restoring every grafted layer gives the teacher again. Used to score
    which layers stay attention (training/graft/select.py)."""
    check_graft_of(teacher, student)
    t, s = teacher.config, student.config
    layers = _layer_indices(layers, s.num_hidden_layers, "restore")
    wrong = sorted(i for i in set(layers) if s.layer_types[i] != MEMORY or t.layer_types[i] != ATTENTION)
    if wrong:
        raise CloverError(f"layers {wrong} are not memory layers of the student in place of the teacher's attention")
    chosen = set(layers)
    layer_types = [ATTENTION if i in chosen else kind for i, kind in enumerate(s.layer_types)]
    config = CloverConfig(**{**s.to_dict(), "layer_types": layer_types})
    mixers = tuple(f"model.layers.{i}.linear_attn." for i in chosen)
    attentions = tuple(f"model.layers.{i}.self_attn." for i in chosen)
    state = {k: v.detach().clone() for k, v in student.state_dict().items() if not k.startswith(mixers)}
    weight = student.model.embed_tokens.weight
    state.update({k: v.detach().to(device=weight.device, dtype=weight.dtype, copy=True)
                  for k, v in teacher.state_dict().items() if k.startswith(attentions)})  # fmt: skip
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied again by clover_from_state
    return clover_from_state(config, state, "the restored student")


def calibration_ids(tokenizer, tokens: int = 384, seed: int = 0) -> torch.Tensor:
    """[1, tokens] ids of chat-templated task prompts and answers: text like what the model will read."""
    from cloverlm.tasks import SUITE, generate
    from cloverlm.tokenizer import format_chat

    ids: list[int] = []
    while len(ids) < tokens:
        for name in SUITE:
            example = generate(name, seed)
            text = "".join(format_chat(tokenizer, example.prompt, example.answer, example.tools))
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        seed += 1
    return torch.tensor([ids[:tokens]])


def graft_with_calibration(
    model: CloverForBlockDiffusion, tokenizer, memory_layers: Sequence[int] | None = None
) -> tuple[CloverForBlockDiffusion, list[int]]:
    """(the graft `clover convert --graft memory` makes of `model`, its memory layers): `memory_layers`, or
    three in four by default, calibrated on task text in `tokenizer`'s chat format (calibration_ids)."""
    layers = list(memory_layers) if memory_layers is not None else default_memory_layers(model.config.num_hidden_layers)
    return graft_memory(model, layers, calibration=calibration_ids(tokenizer)), layers
