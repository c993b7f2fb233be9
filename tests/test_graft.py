"""The graft (issue 30, item 1): memory layers started from the attention layers they replace in a converted
Llama-family model; saved, loaded and decoded like any Clover model."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from cloverlm.cli import main
from cloverlm.convert.base import convert_weights
from cloverlm.convert.graft import GATE_OPEN, default_memory_layers, graft_memory
from cloverlm.convert.load import load_model
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY
from cloverlm.model.layout import BlockLayout
from conftest import tiny_model
from test_engine import MASK, greedy_next_token, prompt

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8  # three query heads per KV head, as SmolLM2's 9 and 3


def converted_llama(vocab_size: int = 300, layers: int = 4, seed: int = 0):
    """A tiny random Llama, converted (every layer block-causal attention); mask id as test_engine's."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, tie_word_embeddings=True,
        eos_token_id=0, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in base.parameters():  # away from the init, so q and k have real norms
            param.add_(torch.randn_like(param) * 0.1)
    return convert_weights(base, MASK)


@pytest.fixture(scope="module")
def source():
    return converted_llama()


def ids(length=40, batch=2, seed=1):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_default_layers_keep_every_fourth_as_attention():
    assert default_memory_layers(8) == [0, 1, 2, 4, 5, 6]
    layers = default_memory_layers(30)
    assert len(layers) == 23 and [i for i in range(30) if i not in layers] == [3, 7, 11, 15, 19, 23, 27]


def test_graft_copies_the_attention_into_the_mixer_and_everything_else(source):
    before = {k: v.clone() for k, v in source.state_dict().items()}
    graft = graft_memory(source, [0, 2])
    assert graft.config.layer_types == [MEMORY, ATTENTION, MEMORY, ATTENTION]
    assert source.config.layer_types == [ATTENTION] * 4  # the source is left as it was
    assert all(torch.equal(before[k], v) for k, v in source.state_dict().items())
    grafted = graft.state_dict()
    for name, value in grafted.items():
        if ".linear_attn." not in name:
            assert torch.equal(value, before[name]), name
    assert not any(k.startswith(("model.layers.0.self_attn", "model.layers.2.self_attn")) for k in grafted)
    assert graft.lm_head.weight.data_ptr() == graft.model.embed_tokens.weight.data_ptr()  # still tied
    assert graft.model.embed_tokens.weight.data_ptr() != source.model.embed_tokens.weight.data_ptr()  # a copy
    d = HEAD_DIM
    for i in (0, 2):
        attention, mixer = source.model.layers[i].self_attn, graft.model.layers[i].linear_attn
        q, k, v = mixer.in_proj_qkv.weight.split([HEADS * d, HEADS * d, HEADS * d])
        assert torch.equal(q, attention.q_proj.weight) and torch.equal(mixer.out_proj.weight, attention.o_proj.weight)
        for head in range(HEADS):  # query head h reads KV head h // 3, as GQA groups them
            kv = head // (HEADS // KV_HEADS)
            assert torch.equal(k[head * d : (head + 1) * d], attention.k_proj.weight[kv * d : (kv + 1) * d])
            assert torch.equal(v[head * d : (head + 1) * d], attention.v_proj.weight[kv * d : (kv + 1) * d])
        kernel = mixer.conv1d.weight[:, 0]
        centre = kernel.shape[-1] // 2
        assert torch.equal(kernel[:, centre], torch.ones(len(kernel))) and kernel.abs().sum() == len(kernel)
        for gate in (mixer.in_proj_b, mixer.in_proj_a, mixer.in_proj_lam):
            assert not gate.weight.any()
        assert mixer.num_k_heads == mixer.num_v_heads == HEADS and mixer.head_k_dim == mixer.head_v_dim == HEAD_DIM
        assert mixer.in_proj_z.weight.abs().sum() > 0  # silu(0) would silence the layer


def test_graft_keeps_the_dtype():
    model = converted_llama(layers=2).to(torch.bfloat16)
    graft = graft_memory(model, [1], calibration=ids(12, 1))
    assert {p.dtype for p in graft.parameters()} == {torch.bfloat16} and not graft.training


def test_grafted_model_saves_loads_and_decodes_as_its_own_forward(source, tmp_path):
    graft = graft_memory(source, [0, 1, 2], calibration=ids())
    save_model(graft, None, tmp_path / "graft")
    loaded = load_model(tmp_path / "graft")
    assert loaded.config.layer_types == graft.config.layer_types
    clean, noisy = ids(32, 1, seed=2), ids(32, 1, seed=3)
    with torch.no_grad():
        expected = graft(clean, noisy, [8, 8, 8, 8]).logits
        assert torch.equal(loaded(clean, noisy, [8, 8, 8, 8]).logits, expected)
    request = prompt(13)
    [done] = Engine(loaded).generate([Request(request, DecodeParams(max_new_tokens=12, block_size=1))])
    assert len(done.tokens) > 0 and done.tokens == greedy_next_token(loaded, request, 12)  # invariant 5


def test_decays_span_the_configured_range():
    model = converted_llama(layers=2)
    model.config.memory_decay_range = (0.995, 0.9999)  # docs/design.md's measured range
    mixer = graft_memory(model, [0]).model.layers[0].linear_attn
    rates = mixer.A_log.exp() * F.softplus(mixer.dt_bias)  # the decay at in_proj_a = 0 is exp(-rate)
    decays = torch.exp(-rates).detach()
    assert math.isclose(decays.min(), 0.995, rel_tol=1e-6) and math.isclose(decays.max(), 0.9999, rel_tol=1e-6)
    steps = (rates[1:] / rates[:-1]).detach()
    assert torch.allclose(steps, steps[0].expand_as(steps), rtol=1e-4)  # log-spaced across the heads


@pytest.mark.parametrize(
    "layers, message",
    [([], "no layers to graft"), ([4], "out of range"), ([-1], "out of range"), ([1, 0, 1], r"\[1\] are given more than once")],
)
def test_bad_layer_lists_get_a_clear_error(source, layers, message):
    with pytest.raises(CloverError, match=message):
        graft_memory(source, layers)


def test_only_attention_layers_of_a_llama_conversion_are_grafted(source):
    with pytest.raises(CloverError, match=r"layers \[0\] are memory layers already"):
        graft_memory(graft_memory(source, [0, 1]), [0, 3])
    assert graft_memory(graft_memory(source, [0]), [1]).config.layer_types[:2] == [MEMORY, MEMORY]
    with pytest.raises(CloverError, match="Llama-family"):
        graft_memory(tiny_model(), [3])  # a from-scratch preset: q/k norm and an output gate


def test_calibration_matches_the_replaced_softmax(source):
    calibration = ids()
    plain = graft_memory(source, [0]).model.layers[0].linear_attn
    mixer = graft_memory(source, [0], calibration=calibration).model.layers[0].linear_attn
    assert torch.allclose(plain._temperature(), torch.full((HEADS,), HEAD_DIM**0.5))
    layer = source.model.layers[0]
    attention = layer.self_attn
    with torch.no_grad():
        x = layer.input_layernorm(source.model.embed_tokens(calibration))  # layer 0's input
        q = (x @ attention.q_proj.weight.T).unflatten(-1, (HEADS, HEAD_DIM)).flatten(0, 1).norm(dim=-1)
        k = (x @ attention.k_proj.weight.T).unflatten(-1, (KV_HEADS, HEAD_DIM)).flatten(0, 1).norm(dim=-1)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=-1)
        pairs = (q[:, None, :] * k[None, :, :]).mean((0, 1)) / HEAD_DIM**0.5  # every (i, j), per head
        assert torch.allclose(mixer._temperature(), pairs, rtol=1e-4)
        assert not torch.allclose(pairs, plain._temperature(), rtol=0.1)  # the measurement moved it
        # the gate is open at the mean input, and the layer's output as large as its attention's
        z = x.flatten(0, 1).mean(0) @ mixer.in_proj_z.weight.T
        assert torch.allclose(z, torch.full_like(z, GATE_OPEN), rtol=1e-4)
        length = calibration.shape[1]
        layout, positions = BlockLayout.build([1] * length, 64, x.device), torch.arange(length)
        expected = attention.forward_streams(None, x, layout, positions)[1].norm(dim=-1).mean()
        assert torch.isclose(mixer.forward_streams(None, x, layout, positions)[1].norm(dim=-1).mean(), expected, rtol=1e-4)


def test_a_silent_attention_grafts_to_finite_weights():
    """An attention that writes nothing (o_proj zero) has no output scale to match: the calibration leaves
    the scale at 1 instead of dividing 0 by 0."""
    model = converted_llama(seed=3)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
    graft = graft_memory(model, [0, 1], calibration=ids())
    assert all(torch.isfinite(p).all() for p in graft.parameters())
    assert torch.isfinite(graft(ids(12, 1)).logits).all()


def test_clover_convert_graft_writes_a_loadable_hybrid(tokenizer, tmp_path, capsys):
    save_model(converted_llama(vocab_size=len(tokenizer), layers=4), tokenizer, tmp_path / "source")
    main(["convert", "--graft", "memory", "--source", str(tmp_path / "source"), "--out", str(tmp_path / "hybrid")])
    assert "3 new memory layers, attention kept at [3]" in capsys.readouterr().out
    assert load_model(tmp_path / "hybrid").config.layer_types == [MEMORY] * 3 + [ATTENTION]
    main(["convert", "--graft", "memory", "--source", str(tmp_path / "source"), "--memory-layers", "1,3", "--out", str(tmp_path / "two")])
    assert load_model(tmp_path / "two").config.layer_types == [ATTENTION, MEMORY, ATTENTION, MEMORY]
    capsys.readouterr()
    main(["convert", "--graft", "memory", "--source", str(tmp_path / "two"), "--memory-layers", "0", "--out", str(tmp_path / "more")])
    assert "1 new memory layers, attention kept at [2]" in capsys.readouterr().out  # a graft of a graft
    more, two = load_model(tmp_path / "more"), load_model(tmp_path / "two")
    assert more.config.layer_types == [MEMORY, MEMORY, ATTENTION, MEMORY]
    assert all(torch.equal(v, two.state_dict()[k]) for k, v in more.state_dict().items() if ".layers.0." not in k)
    main(["convert", "--graft", "memory", "--source", str(tmp_path / "two"), "--memory-layers", "all", "--out", str(tmp_path / "all")])
    assert "2 new memory layers, attention kept at []" in capsys.readouterr().out
    assert load_model(tmp_path / "all").config.layer_types == [MEMORY] * 4
    with pytest.raises(SystemExit):
        main(["convert", "--graft", "memory", "--source", str(tmp_path / "source"), "--memory-layers", "1,x", "--out", str(tmp_path / "bad")])
    assert "--memory-layers expects comma-separated numbers" in capsys.readouterr().err
