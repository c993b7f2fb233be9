"""Conversion from Qwen3.5-MoE (docs/design.md section 7) on a tiny random model built from transformers'
config class: strict loading, exactness at block size 1 against transformers, the delta-mixing
memory layer's two paths (training forward and decoding) agreeing at larger blocks, and one-line
errors for checkpoints that are not Qwen3.5-MoE."""

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from cloverlm.cli import main
from cloverlm.convert.load import load_model
from cloverlm.convert.qwen import (
    convert_qwen,
    convert_qwen_weights,
    converted_qwen,
    is_qwen_folder,
    qwen_clover_config,
)
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.errors import CloverError
from cloverlm.model.cache import CloverCache
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.config import parameter_counts

VOCAB, MASK = 300, 299  # the mask defaults to the last embedding row


def tiny_qwen(seed: int = 0, tie: bool = False) -> Qwen3_5MoeForCausalLM:
    """3 gated-delta layers + 1 full-attention layer, 4 experts top-2, GQA in both mixers, partial rotary."""
    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, rms_norm_eps=1e-6,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=tie,
    )  # fmt: skip
    model = Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():  # move norms, gates and decays off their initial values so each mapping matters
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.3 if name.endswith(("norm.weight", "A_log", "dt_bias")) else 0.05))
    return model


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=words[1:3])


@pytest.fixture(scope="module")
def pair():
    base = tiny_qwen()
    return base, converted_qwen(base)


def random_ids(shape, seed):
    return torch.randint(2, VOCAB - 10, shape, generator=torch.Generator().manual_seed(seed))


def test_config_and_weights_map_strictly(pair):
    base, model = pair
    c = model.config
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert c.memory_block_mixing == "delta" and c.rms_norm_zero_centered and c.causal_clean_stream
    assert (c.rotary_dim, c.linear_conv_kernel_dim, c.mask_token_id) == (4, 7, MASK)
    config = qwen_clover_config(base.config)
    state = convert_qwen_weights(base.state_dict(), base.config, config)
    CloverForBlockDiffusion(config).load_state_dict(state, strict=True)  # every tensor has its place
    # The only parameters Clover adds: the K - 1 (zero) future taps of each memory layer's conv.
    conv = sum(layer.linear_attn.conv1d.weight.shape[0] for layer in base.model.layers if hasattr(layer, "linear_attn"))
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in base.parameters()) + 3 * conv == parameter_counts(c)["total_params"]


def test_block_size_one_reproduces_the_qwen_logits(pair):
    """Exact (to fp32 rounding) for every part: gated delta rule, conv, gated norm, attention with
    output gate, q/k norm and partial rotary, MoE routing and shared expert, (1 + w) norms."""
    base, model = pair
    ids = random_ids((2, 21), 1)
    with torch.no_grad():
        reference = base(ids).logits
        assert (model(ids).logits - reference).abs().max() < 1e-4  # two-stream training forward, blocks of 1
        cache = CloverCache.empty(model.config, 2)
        model.prefill(ids[:, :-1], [8, 8, 4], cache)  # committed tokens are causal: any partition
        last = model.decode(cache, step_ids=ids[:, -1:]).logits
    assert (last[:, 0] - reference[:, -1]).abs().max() < 1e-4


def test_block_size_one_decodes_as_transformers_generate(pair):
    base, model = pair
    prompt = random_ids((7,), 2).tolist()
    with torch.no_grad():
        expected = base.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    expected = expected[0, len(prompt) :].tolist()
    if model.config.eos_token_id in expected:  # the engine stops at the end token
        expected = expected[: expected.index(model.config.eos_token_id)]
    [done] = Engine(model).generate([Request(prompt, DecodeParams(max_new_tokens=10, block_size=1))])
    assert done.tokens == expected


def test_delta_mixing_training_forward_equals_decoding(pair):
    """Invariant 2 for memory_block_mixing="delta" at block size 4: each noisy block of the training
    forward (with masks) gives the logits of a denoising step after the clean blocks before it."""
    _, model = pair
    ids = random_ids((1, 16), 3)
    noisy = ids.clone()
    noisy[:, [1, 2, 6, 9, 10, 11, 15]] = MASK
    with torch.no_grad():
        train = model(ids, noisy_input_ids=noisy, block_sizes=[4, 4, 4, 4]).logits
        for start in range(0, 16, 4):
            cache = CloverCache.empty(model.config, 1)
            if start:
                model.prefill(ids[:, :start], [start], cache)
            step = model.decode(cache, step_ids=noisy[:, start : start + 4]).logits
            assert (step - train[:, start : start + 4]).abs().max() < 1e-4
        # A denoising step leaves the memory state as it found it (its delta-rule pass is scratch).
        cache = CloverCache.empty(model.config, 1)
        model.prefill(ids[:, :8], [8], cache)
        state = cache.layers[0].state.clone()
        model.decode(cache, step_ids=noisy[:, 8:12])
        assert torch.equal(cache.layers[0].state, state)


def test_delta_mixing_on_the_fused_kernel_path(pair, monkeypatch):
    """The CUDA path (fla's kernel, both streams interleaved; here a CPU stand-in with fla's calling
    convention) takes the adjusted noisy queries as they are and gives the reference's logits."""
    from cloverlm.ops import fla_backend
    from test_cuda import fake_fla

    _, model = pair
    ids = random_ids((2, 16), 8)
    noisy = ids.clone()
    noisy[:, 3::2] = MASK
    with torch.no_grad():
        reference = model(ids, noisy_input_ids=noisy, block_sizes=[1, 4, 8, 3]).logits
        calls = []
        monkeypatch.setattr(fla_backend, "_fla_function", lambda *a, **kw: calls.append(1) or fake_fla(*a, **kw))
        monkeypatch.setattr(fla_backend, "DEVICES", ("cpu",))
        monkeypatch.setattr(fla_backend, "BACKEND", "auto")
        fused = model(ids, noisy_input_ids=noisy, block_sizes=[1, 4, 8, 3]).logits
    assert len(calls) == 3  # one fused call per memory layer
    assert (fused - reference).abs().max() < 1e-4


def test_batched_blocks_decode_as_alone(pair):
    """Rows of different lengths (padded blocks) decode as each would alone at block size 4."""
    _, model = pair
    prompts = [random_ids((n,), 10 + n).tolist() for n in (5, 11)]
    params = DecodeParams(max_new_tokens=9, block_size=4)
    together = Engine(model).generate([Request(p, params) for p in prompts])
    alone = [Engine(model).generate([Request(p, params)])[0] for p in prompts]
    assert [d.tokens for d in together] == [d.tokens for d in alone]


def test_tied_embeddings_stay_tied():
    base = tiny_qwen(seed=4, tie=True)
    model = converted_qwen(base)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = random_ids((1, 9), 5)
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() < 1e-4


def test_composite_checkpoint_drops_vision_and_mtp(pair):
    """The released checkpoints are vision + text (model.language_model.*, model.visual.*, mtp.*)."""
    base, model = pair
    composite = Qwen3_5MoeConfig(text_config=base.config.to_dict())
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in base.state_dict().items()}
    state |= {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(3), "mtp.fc.weight": torch.zeros(3)}
    config = qwen_clover_config(composite)
    assert config.to_dict() == qwen_clover_config(base.config).to_dict()
    converted = convert_qwen_weights(state, composite, config)
    assert converted.keys() == model.state_dict().keys()


def test_folder_round_trip(pair, tmp_path):
    base, model = pair
    base.save_pretrained(tmp_path / "qwen")  # safetensors
    assert is_qwen_folder(tmp_path / "qwen")
    tiny_tokenizer().save_pretrained(tmp_path / "qwen")
    main(["convert", "--base", str(tmp_path / "qwen"), "--out", str(tmp_path / "clover")])  # dispatched by model_type
    loaded = load_model(tmp_path / "clover")
    # The chat's end of turn ends an answer; the mask is the last row, past the tokenizer's vocabulary.
    assert (loaded.config.eos_token_id, loaded.config.mask_token_id) == (2, MASK)
    assert (tmp_path / "clover" / "tokenizer.json").is_file()
    ids = random_ids((1, 12), 6)
    with torch.no_grad():
        assert (loaded(ids).logits - base(ids).logits).abs().max() < 1e-4
    convert_qwen(base, tmp_path / "clover-in-memory")
    assert json.loads((tmp_path / "clover-in-memory" / "config.json").read_text())["memory_block_mixing"] == "delta"


def test_other_checkpoints_are_refused(tmp_path):
    llama = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(CloverError, match="cannot convert a 'llama' checkpoint with convert_qwen"):
        qwen_clover_config(llama)
    with pytest.raises(CloverError, match="Qwen3.5-MoE only"):
        convert_qwen_weights({}, llama, None)
    llama.save_pretrained(tmp_path)
    assert not is_qwen_folder(tmp_path)
    with pytest.raises(CloverError, match="holds a 'llama' model, not Qwen3.5-MoE"):
        convert_qwen(tmp_path, tmp_path / "out")
    config = tiny_qwen().config
    config.hidden_act = "gelu"
    with pytest.raises(CloverError, match="silu"):
        qwen_clover_config(config)
