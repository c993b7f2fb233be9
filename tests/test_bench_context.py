"""clover bench's context_scaling section: a block's forward against the context it reads, for Clover, a
memory-only model, the graft of an all-attention Clover (--hybrid) and the peer, with each one's cache
bytes; and the loading of a hybrid beside its source."""

import dataclasses
import re

import pytest
import torch

from cloverlm import CloverError, preset_config
from cloverlm.bench import context as context_module
from cloverlm.bench.context import MEMORY_PRESET, _medians_ms, bench_context, random_memory_model
from cloverlm.bench.options import load_models
from cloverlm.cli import main
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY
from test_bench import (
    CONTEXT_FIELDS,
    OPTIONS,
    RATIO_ROUNDING,
    VOCAB,
    bench_models,
    bench_tokenizer,
    tiny_all_attention,
    tiny_hybrid,
)


@pytest.fixture(scope="module")
def tokenizer():
    return bench_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    return bench_models(tokenizer)


def test_context_scaling_without_a_memory_model_times_a_seeded_random_one(models):
    """No --memory-model: a random-init model of the memory-only preset, the same weights every run."""
    first, second = random_memory_model(), random_memory_model()
    assert first.config.layer_types == ["linear_attention"] * 4 and first.config.vocab_size == 8192
    assert first.config.to_dict() == preset_config(MEMORY_PRESET).to_dict()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True))
    options = dataclasses.replace(OPTIONS, contexts=(64,), timed_forwards=1)
    (row,) = bench_context(dataclasses.replace(models, memory_only=None, peer=None, hybrid=None), options, tpf=2.0)
    assert row["memory_only_block_ms"] > 0 and row["clover_block_ms"] > 0 and row["peer_token_ms"] is None


def kv_bytes_per_token(config) -> int:
    """fp32 keys and values of one token in every attention layer of a Clover or peer config."""
    return 2 * config.num_key_value_heads * config.head_dim * 4 * config.layer_types.count(ATTENTION)


def memory_state_bytes(config) -> int:
    """fp32 recurrent state [Hv, Dk, Dv] and conv tail [r, C] of every memory layer of a Clover config."""
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + config.linear_num_value_heads * config.linear_value_head_dim
    return 4 * (state + config.conv_radius * channels) * config.layer_types.count(MEMORY)


def test_context_scaling_times_a_hybrid_beside_its_all_attention_source(models, monkeypatch):
    """--hybrid: the graft of an all-attention Clover, timed beside it; the attention layers' cache grows
    with the context, the memory layers' not. Past the prefill limit (64 here) the context is committed
    block by block into buffers that double when full (512 positions for 320 tokens): only the filled
    positions count."""
    monkeypatch.setattr(context_module, "PREFILL_LIMIT", 64)
    source = tiny_all_attention()
    contexts = (64, 128, 320)
    options = dataclasses.replace(OPTIONS, contexts=contexts, timed_forwards=1)
    rows = bench_context(dataclasses.replace(models, clover=source, hybrid=tiny_hybrid(source)), options, tpf=2.0)
    assert [row["context"] for row in rows] == list(contexts)
    hybrid_config, memory_config, peer = tiny_hybrid(source).config, models.memory_only.config, models.peer.config
    assert hybrid_config.layer_types == [MEMORY] * 3 + [ATTENTION]
    for row in rows:
        assert set(row) == CONTEXT_FIELDS
        context = row["context"]
        assert row["hybrid_vs_clover"] == pytest.approx(row["hybrid_block_ms"] / row["clover_block_ms"], rel=1e-2, abs=RATIO_ROUNDING)
        assert row["clover_cache_bytes"] == context * kv_bytes_per_token(source.config)  # all attention: linear, no constant
        assert row["hybrid_cache_bytes"] == memory_state_bytes(hybrid_config) + context * kv_bytes_per_token(hybrid_config)
        assert row["memory_only_cache_bytes"] == memory_state_bytes(memory_config)  # no attention layer: constant
    # a quarter of the layers keep keys: the hybrid's cache grows a quarter as fast as its source's
    growth = {name: rows[-1][f"{name}_cache_bytes"] - rows[0][f"{name}_cache_bytes"] for name in ("clover", "hybrid", "memory_only", "peer")}
    assert growth["hybrid"] * 4 == growth["clover"] > 0 and growth["memory_only"] == 0
    # the peer (Qwen3.5-MoE, three linear-attention layers to one full): keys of one layer a token, plus constant states
    per_token = 2 * peer.num_key_value_heads * peer.head_dim * 4 * peer.layer_types.count("full_attention")
    assert growth["peer"] == (contexts[-1] - contexts[0]) * per_token
    assert rows[0]["peer_cache_bytes"] > contexts[0] * per_token


def test_timed_forwards_take_turns():
    calls = []
    medians = _medians_ms([lambda: calls.append("a"), lambda: calls.append("b")], 3)
    assert calls == ["a", "b"] * 4 and len(medians) == 2  # the warm-ups, then three timed rounds
    assert all(ms >= 0 for ms in medians)


def test_load_models_takes_a_hybrid_of_the_same_vocabulary(tokenizer, tmp_path):
    source = tiny_all_attention()
    save_model(source, tokenizer, tmp_path / "clover")
    save_model(tiny_hybrid(source), tokenizer, tmp_path / "hybrid")
    loaded = load_models(tmp_path / "clover", None, None, hybrid_dir=tmp_path / "hybrid")
    assert loaded.hybrid.config.layer_types == [MEMORY] * 3 + [ATTENTION] and loaded.folders["hybrid"] == str(tmp_path / "hybrid")
    assert load_models(tmp_path / "clover", None, None).hybrid is None
    save_model(tiny_hybrid(tiny_all_attention(vocab_size=VOCAB + 64)), tokenizer, tmp_path / "other")
    with pytest.raises(CloverError, match=re.escape(f"the hybrid at {tmp_path / 'other'} has a vocabulary of {VOCAB + 64} tokens, {tmp_path / 'clover'} one of {VOCAB}:")):
        load_models(tmp_path / "clover", None, None, hybrid_dir=tmp_path / "other")


def test_cli_hybrid_needs_the_context_section(tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["bench", "--hybrid", str(tmp_path), "--sections", "tasks", "--no-peer"])
    assert raised.value.code == 2
    assert capsys.readouterr().err == "error: --hybrid is timed in the context_scaling section: add it to --sections\n"
