"""The model: invariant 2 (two-stream training pass == block-by-block decoding), invariant 6
(grouped_mm dispatch == loop dispatch), prefill, save/load, and clear errors for bad input."""

import pytest
import torch
from transformers import AutoConfig, AutoModel

from cloverlm import CloverCache, CloverConfig, CloverError, preset_config
from cloverlm.convert.load import load_model
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import ATTENTION, MEMORY, parameter_counts
from cloverlm.ops.moe import dispatch_experts
from conftest import tiny_model

SIZES = [3, 1, 8, 4, 1, 16, 7, 1, 2, 64, 5]


def noisy_pair(length, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(3, 300, (batch, length), generator=g)
    xt = torch.where(torch.rand(batch, length, generator=g) < 0.5, torch.full_like(x0, 2), x0)
    return x0, xt


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-memory"])
def test_two_stream_equals_decoding_path(preset):
    model = tiny_model(preset)
    x0, xt = noisy_pair(sum(SIZES))
    with torch.no_grad():
        parallel = model(x0, xt, SIZES).logits
        cache = CloverCache.empty(model.config, batch=2)
        start = 0
        for size in SIZES:
            step = model.decode(cache, step_ids=xt[:, start : start + size]).logits
            torch.testing.assert_close(step, parallel[:, start : start + size], atol=1e-4, rtol=1e-4)
            model.decode(cache, commit_ids=x0[:, start : start + size])
            start += size
    assert cache.lengths.tolist() == [sum(SIZES)] * 2


def test_noisy_stream_never_reads_its_own_future_or_other_noise():
    model = tiny_model()
    x0, xt = noisy_pair(40)
    sizes = [8] * 5
    with torch.no_grad():
        base = model(x0, xt, sizes).logits
        # changing later blocks (either stream) must not change block 2's logits
        x0b, xtb = x0.clone(), xt.clone()
        x0b[:, 24:], xtb[:, 24:] = 7, 9
        # and the noisy tokens of earlier blocks are never read: history is clean
        xtb[:, :16] = 2
        other = model(x0b, xtb, sizes).logits
    torch.testing.assert_close(other[:, 16:24], base[:, 16:24])
    assert not torch.allclose(other[:, 24:], base[:, 24:])


@pytest.mark.parametrize("causal_clean", [False, True])
def test_prefill_equals_block_by_block_commits(model, causal_clean):
    """Prefill attends in one call (block-causal mask, or is_causal for a causal clean stream: the
    kernel then skips the upper triangle); commits attend block by block against the cache."""
    if causal_clean:
        model = tiny_model(layer_types=[ATTENTION] * 4, causal_clean_stream=True)
    x0, _ = noisy_pair(sum(SIZES))
    with torch.no_grad():
        sequential = CloverCache.empty(model.config, batch=2)
        start = 0
        for size in SIZES:
            model.decode(sequential, commit_ids=x0[:, start : start + size])
            start += size
        parallel = CloverCache.empty(model.config, batch=2)
        model.prefill(x0, SIZES, parallel)
        for a, b in zip(sequential.layers, parallel.layers):
            for name in ("state", "conv_tail"):
                if getattr(a, name) is not None:
                    torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=1e-5, rtol=1e-5)
            for x, y in zip(a.cached_kv(), b.cached_kv()):
                if x is not None:
                    torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
        block = torch.full((2, 4), 2)
        torch.testing.assert_close(
            model.decode(parallel, step_ids=block).logits, model.decode(sequential, step_ids=block).logits, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("causal_clean, mixing", [(False, "attention"), (True, "attention"), (False, "delta")])
def test_fused_commit_and_step_equal_separate_calls(causal_clean, mixing):
    """Invariant 3 (docs/design.md): a forward that commits one block and denoises the next (each
    projection one call over both, one attention call over the joint mask in attention layers) gives the
    step's logits and the cache of a commit call followed by a step call: rows with padded blocks of
    different lengths, different histories, and drafted step inputs."""
    # each kind before the other: a commit's output reaches later layers' history
    model = tiny_model(layer_types=[ATTENTION, MEMORY, ATTENTION, MEMORY], causal_clean_stream=causal_clean,
                       memory_block_mixing=mixing)
    x0, _ = noisy_pair(40, seed=3)
    fused, separate = CloverCache.empty(model.config, batch=2), CloverCache.empty(model.config, batch=2)
    rounds = [  # (commit valid counts, step valid counts, drafted step inputs from)
        ([6, 6], [6, 6], None), ([6, 3], [4, 6], None), ([2, 5], [5, 5], 3), ([1, 1], [6, 2], None),
    ]
    with torch.no_grad():
        for cache in (fused, separate):
            model.prefill(x0[:, :8], [4, 4], cache)
        for commit_counts, step_counts, drafted_from in rounds:
            commit_valid = torch.arange(6)[None] < torch.tensor(commit_counts)[:, None]
            step_valid = torch.arange(6)[None] < torch.tensor(step_counts)[:, None]
            commit_ids, step_ids = x0[:, 8:14], torch.where(torch.arange(6) % 2 == 0, x0[:, 20:26], 2)
            causal = None if drafted_from is None else (torch.arange(6) >= drafted_from)[None].expand(2, -1) & step_valid
            joint = model.decode(fused, commit_ids, commit_valid, step_ids, step_valid, step_causal=causal).logits
            model.decode(separate, commit_ids, commit_valid)
            alone = model.decode(separate, step_ids=step_ids, step_valid=step_valid, step_causal=causal).logits
            torch.testing.assert_close(joint[step_valid], alone[step_valid], atol=1e-5, rtol=1e-5)
            assert fused.lengths.tolist() == separate.lengths.tolist()
        for a, b in zip(fused.layers, separate.layers):
            for x, y in ((a.state, b.state), (a.conv_tail, b.conv_tail)):
                if x is not None:
                    torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
            for x, y in zip(a.cached_kv(), b.cached_kv()):
                if x is not None:
                    for row, length in enumerate(fused.lengths.tolist()):
                        torch.testing.assert_close(x[row, :, :length], y[row, :, :length], atol=1e-5, rtol=1e-5)


def test_masked_tokens_never_enter_the_cache(model):
    x0, _ = noisy_pair(16)
    cache = CloverCache.empty(model.config, batch=2)
    with torch.no_grad():
        model.prefill(x0, [8, 8], cache)
        def history():
            return [[None if t is None else t.clone() for t in (c.state, c.conv_tail, *c.cached_kv())] for c in cache.layers]

        before = history()
        model.decode(cache, step_ids=torch.full((2, 8), 2))
    assert cache.lengths.tolist() == [16, 16]
    # the step's keys may sit in an attention buffer's spare room, but what the cache holds is unchanged
    for old, new in zip(before, history()):
        for a, b in zip(old, new):
            assert (a is None and b is None) or torch.equal(a, b)


def test_grouped_mm_equals_loop_dispatch():
    torch.manual_seed(0)
    experts, hidden, inter, tokens, top_k = 6, 16, 24, 50, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, requires_grad=True)
    down = torch.randn(experts, hidden, inter, requires_grad=True)
    x = torch.randn(tokens, hidden, requires_grad=True)
    ids = torch.randint(0, experts - 1, (tokens, top_k))  # the last expert gets no tokens
    weights = torch.rand(tokens, top_k)
    results = []
    for grouped in (True, False):
        for t in (x, gate_up, down):
            t.grad = None
        out = dispatch_experts(x, ids, weights, gate_up, down, use_grouped_mm=grouped)
        out.backward(torch.ones_like(out).contiguous())  # a dense gradient: grouped_mm's CPU backward fails on a zero-stride one
        results.append((out.detach(), x.grad.clone(), gate_up.grad.clone(), down.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # and the loop is the definition: one token through its experts by hand
    token = 0
    expected = sum(
        weights[token, j] * (torch.nn.functional.silu(gate_up[ids[token, j], :inter] @ x[token]) * (gate_up[ids[token, j], inter:] @ x[token])) @ down[ids[token, j]].T
        for j in range(top_k)
    )
    torch.testing.assert_close(results[1][0][token], expected.detach(), atol=1e-4, rtol=1e-4)


def test_router_bias_changes_choice_not_weights(model):
    block = model.moe_blocks()[0]
    x = torch.randn(1, 10, model.config.hidden_size)
    with torch.no_grad():
        base, _ = block(x)
        block.expert_bias.fill_(0.0)
        block.expert_bias[0] = 100.0  # force expert 0 into every top-k
        forced, _ = block(x)
    assert not torch.allclose(base, forced)
    block.train()
    block.expert_load.zero_()
    block(x)
    load = block.expert_load.clone()
    assert load[0] == 10 and load.sum() == 10 * block.top_k  # every token routed to expert 0
    before = block.expert_bias.clone()
    block.update_bias(0.5)
    # overloaded experts are pushed down, idle ones up, by the rate
    torch.testing.assert_close(block.expert_bias, before + 0.5 * torch.sign(load.mean() - load))
    assert (block.expert_load == 0).all()


def test_save_load_round_trip(tmp_path, model):
    save_model(model, None, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    x0, xt = noisy_pair(24)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x0, xt, [8, 8, 8]).logits, model(x0, xt, [8, 8, 8]).logits)
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / "model.safetensors").exists()
    # through transformers' Auto classes too
    assert type(AutoConfig.from_pretrained(tmp_path / "m")) is CloverConfig
    auto = AutoModel.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        torch.testing.assert_close(auto(x0, xt, [8, 8, 8]).logits, model(x0, xt, [8, 8, 8]).logits)


def test_layer_types_accept_friendly_names():
    config = CloverConfig(num_hidden_layers=2, layer_types=["memory", "attention"])
    assert config.layer_types == [MEMORY, ATTENTION]
    assert preset_config("clover-tiny").layer_types == [MEMORY, MEMORY, MEMORY, ATTENTION]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_attention_heads=5), "num_attention_heads=5 is not a multiple of num_key_value_heads=2"),
        (dict(num_hidden_layers=3, layer_types=["memory"] * 4), "layer_types has 4 entries but num_hidden_layers=3"),
        (dict(linear_conv_kernel_dim=4), "linear_conv_kernel_dim=4 must be odd"),
        (dict(num_experts_per_tok=99), "num_experts_per_tok=99 must be in 1..num_experts=64"),
        (dict(layer_types=["memory", "rnn", "memory", "attention"]), "unknown layer types"),
        (dict(mask_token_id=9000), "mask_token_id=9000 is outside the vocabulary"),
    ],
)
def test_inconsistent_config_is_one_clear_error(overrides, message):
    with pytest.raises(CloverError, match=message):
        preset_config("clover-tiny", **overrides)


def test_bad_blocks_and_inputs(model):
    x0, xt = noisy_pair(20)
    with pytest.raises(CloverError, match="block sizes sum to 16 but the sequence has 20 tokens"):
        model(x0, xt, [8, 8])
    with pytest.raises(CloverError, match=r"block sizes \[80\] are outside 1..64"):
        model(torch.randint(3, 300, (1, 80)), None, [80])
    with pytest.raises(CloverError, match="empty input"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(CloverError, match="token ids must be in 0..299"):
        model(torch.full((1, 4), 300))
    with pytest.raises(CloverError, match="block size 65 is above the model's limit of 64"):
        model.decode(CloverCache.empty(model.config), step_ids=torch.randint(3, 300, (1, 65)))


def test_keep_written_refuses_a_cache_with_memory_layers(model):
    cache = CloverCache.empty(model.config)
    with pytest.raises(CloverError, match="keep_written needs an all-attention cache: memory layers fold blocks in by commits"):
        cache.keep_written(torch.tensor([1]))
    assert cache.lengths.tolist() == [0]  # refused before anything moved


@pytest.mark.parametrize("preset, total, active", [("clover-35b-a3b", 35e9, 3e9), ("clover-1b-a0.3b", 1e9, 0.3e9)])
def test_reference_presets_match_their_names(preset, total, active):
    counts = parameter_counts(preset_config(preset))
    assert abs(counts["total_params"] / total - 1) < 0.05
    assert abs(counts["active_params"] / active - 1) < 0.05


def test_counts_match_the_built_model():
    model = tiny_model()
    counts = parameter_counts(model.config)
    built = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    assert counts["total_params"] == built
    config = preset_config("clover-tiny")
    counts = parameter_counts(config)
    assert counts["total_params"] >= 4 * counts["active_params"]
