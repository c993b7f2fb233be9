"""The autoregressive peer (transformers' Qwen3.5-MoE): size, layout, checkpoints, decoding, training."""

import json
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

from cloverlm import CloverError, preset_config
from cloverlm.convert.load import load_model
from cloverlm.convert.peer import (
    build_peer,
    load_peer,
    next_token_loss,
    peer_config,
    peer_generate,
    save_peer,
)
from cloverlm.evaluation.heldout import answer_budget, heldout_examples
from cloverlm.model.config import parameter_counts
from cloverlm.tasks import get_task
from conftest import TINY


def tiny_peer(seed: int = 0):
    """A random tiny peer; weights are jittered so that routers and gates are far from their init."""
    torch.manual_seed(seed)
    model = build_peer(peer_config(preset_config("clover-tiny", **TINY))).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def kind_of(layer) -> str:
    return "linear_attention" if hasattr(layer, "linear_attn") else "full_attention"


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-memory"])
def test_peer_has_clovers_size_and_layer_pattern(preset):
    clover = preset_config(preset, vocab_size=8192)
    model = build_peer(peer_config(clover))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # counted once below
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - parameter_counts(clover)["total_params"]) < 0.1 * parameter_counts(clover)["total_params"]
    assert [kind_of(layer) for layer in model.model.layers] == clover.layer_types
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (clover.num_experts, 2 * clover.moe_intermediate_size, clover.hidden_size)


def test_next_token_loss_scores_eligible_tokens_from_their_prefix():
    model = tiny_peer()
    ids = torch.randint(3, 300, (2, 20))
    eligible = torch.rand(2, 20, generator=torch.Generator().manual_seed(1)) < 0.5
    eligible[:, 0] = True  # position 0 has no history: never scored
    with torch.no_grad():
        loss, aux, _ = next_token_loss(model, ids, eligible)
        expected = [
            F.cross_entropy(model(ids[b : b + 1, :i], use_cache=False).logits[0, -1], ids[b, i])
            for b in range(2)
            for i in range(1, 20)
            if eligible[b, i]
        ]
    torch.testing.assert_close(loss, torch.stack(expected).mean(), atol=1e-5, rtol=1e-5)
    assert float(aux) > 0  # the router balancing loss comes back too


def test_runs_on_transformers_pure_pytorch_fallbacks():
    with torch.no_grad():
        tiny_peer()(torch.tensor([[5, 6, 7]]), use_cache=False)
    assert "fla" not in sys.modules  # flash-linear-attention breaks those fallbacks on CPU


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    model = tiny_peer()
    save_peer(model, None, tmp_path / "peer")
    assert sorted(p.name for p in (tmp_path / "peer").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_peer(tmp_path / "peer")
    ids = torch.randint(3, 300, (2, 40))
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def greedy_without_cache(model, prompt: list[int], steps: int) -> list[int]:
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            sequence.append(int(model(torch.tensor([sequence]), use_cache=False).logits[0, -1].argmax()))
    return sequence[len(prompt) :]


def test_peer_generate_returns_new_tokens_and_stops_before_a_stop_id():
    model = tiny_peer(seed=3)
    prompt = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = greedy_without_cache(model, prompt, 10)
    assert peer_generate(model, prompt, max_new_tokens=10) == expected  # the cache changes nothing
    stop = next(token for token in expected if token != expected[0])
    cut = expected.index(stop)
    assert peer_generate(model, prompt, max_new_tokens=10, stop_ids=(stop, 299)) == expected[:cut]
    with pytest.raises(CloverError, match="empty prompt"):
        peer_generate(model, [])
    with pytest.raises(CloverError, match="max_new_tokens must be at least 1"):
        peer_generate(model, [5], max_new_tokens=0)


def assert_one_line_error(call, match: str):
    with pytest.raises(CloverError, match=match) as raised:
        call()
    assert "\n" not in str(raised.value)


def test_bad_peer_checkpoints_get_one_line_errors(tmp_path):
    save_peer(tiny_peer(), None, tmp_path / "peer")
    pickled = tmp_path / "peer.pt"
    pickled.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    assert_one_line_error(lambda: load_peer(pickled), "looks like a pickle")
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "peer" / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({}))
    assert_one_line_error(lambda: load_peer(folder), "pickle checkpoints are refused")
    weights = tmp_path / "peer" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_one_line_error(lambda: load_peer(tmp_path / "peer"), "corrupt or truncated")
    # each loader refuses the other architecture's folder instead of misreading it
    save_peer(tiny_peer(), None, tmp_path / "good")
    assert_one_line_error(lambda: load_model(tmp_path / "good"), "holds a 'qwen3_5_moe_text' model")


# ----------------------------------------------------------------------------------------------
# Training with the shared trainer


@pytest.fixture
def stdlib_tokenized_once(monkeypatch):
    """Every Trainer tokenizes the stdlib (~20 s); the runs of one test share a tokenizer, so once is enough."""
    from cloverlm.training.scratch import train

    cache = {}
    original = train.tokenize_stdlib

    def tokenize(tokenizer, split, every=1):
        if (split, every) not in cache:
            cache[split, every] = original(tokenizer, split, every)
        return cache[split, every]

    monkeypatch.setattr(train, "tokenize_stdlib", tokenize)


PEER_TRAIN_ARGS = [
    "--arch", "qwen3.5-moe", "--recipe", "default", "--seq-len", "512", "--batch-size", "2", "--max-steps", "3",
    "--eval-every", "100", "--checkpoint-every", "1", "--probe-examples", "1",
    "--set", "hidden_size=32", "--set", "num_experts=4", "--set", "moe_intermediate_size=16",
    "--set", "shared_expert_intermediate_size=32", "--set", "linear_key_head_dim=8",
    "--set", "linear_value_head_dim=8", "--set", "head_dim=8",
]  # fmt: skip


def logged(run) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in logged(run) if "loss" in r}


@pytest.mark.slow
def test_peer_trains_checkpoints_and_resumes_exactly(tmp_path, small_tokenizer, stdlib_tokenized_once, monkeypatch, capsys):
    from safetensors.torch import load_file

    from cloverlm.cli import main
    from cloverlm.training.scratch.train import Trainer

    def train(out, *extra, args=PEER_TRAIN_ARGS):
        main(["train", "--out", str(out), *args, "--tokenizer", str(small_tokenizer), *extra])

    train(tmp_path / "ref")
    real_step = Trainer.train_step

    def crash_at_step_2(self, step):
        if step == 2:
            raise RuntimeError("simulated crash")
        return real_step(self, step)

    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        patch.setattr(Trainer, "train_step", crash_at_step_2)
        train(tmp_path / "crashed")
    assert list(losses(tmp_path / "crashed")) == [0, 1]
    capsys.readouterr()
    without_arch = [a for a in PEER_TRAIN_ARGS if a not in ("--arch", "qwen3.5-moe")]
    with pytest.raises(SystemExit):
        train(tmp_path / "crashed", "--resume", args=without_arch)
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'crashed'} is a run of --arch qwen3.5-moe; resume it with the same --arch"
    )
    train(tmp_path / "crashed", "--resume")

    assert losses(tmp_path / "crashed") == losses(tmp_path / "ref") and len(losses(tmp_path / "ref")) == 3
    reference = load_file(str(tmp_path / "ref" / "checkpoint" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "crashed" / "checkpoint" / "model.safetensors"))
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        assert torch.equal(resumed[name], tensor), name
    (evaluation,) = [r for r in logged(tmp_path / "ref") if r.get("event") == "eval"]
    probes = {f"copy_{task}_b1" for task in ("no_fly_zones", "kv_retrieval", "tool_call", "repeat")}
    assert set(evaluation) == {"event", "step", "elbo_b1", "copy", *probes}  # no b16 metrics for the peer
    assert 0 < evaluation["elbo_b1"] < 10
    load_peer(tmp_path / "ref" / "checkpoint")  # a training checkpoint is a peer model folder


def test_unknown_arch_is_a_one_line_error(tmp_path, capsys):
    from cloverlm.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["train", "--arch", "gpt-2", "--out", str(tmp_path / "run"), "--max-steps", "1"])
    assert exit.value.code == 2
    assert capsys.readouterr().err == "error: unknown arch 'gpt-2'; choose from: clover, qwen3.5-moe\n"


def test_cli_generates_and_evaluates_from_a_peer_folder(tmp_path, tokenizer, capsys):
    from cloverlm.cli import main

    torch.manual_seed(0)
    model = build_peer(peer_config(preset_config("clover-tiny", **{**TINY, "vocab_size": len(tokenizer)}))).eval()
    save_peer(model, tokenizer, tmp_path / "peer")
    main(["generate", "--model", str(tmp_path / "peer"), "--raw", "--max-new-tokens", "6", "def main():"])
    out, err = capsys.readouterr()
    stops = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    expected = peer_generate(model, tokenizer("def main():", add_special_tokens=False)["input_ids"], 6, stops)
    assert out == tokenizer.decode(expected) + "\n"
    assert err.strip() == f"[{len(expected)} tokens, autoregressive: one forward per token]"
    report_path = tmp_path / "eval.json"
    main(["eval", "--model", str(tmp_path / "peer"), "--n", "1", "--tasks", "no_fly_zones", "--messages", "1",
          "--free", "--json", str(report_path)])  # fmt: skip
    (example,) = heldout_examples(tokenizer, "no_fly_zones", 1, 1 << 30, n_messages=1)
    tokens = peer_generate(model, example.ids[: example.prompt_length], answer_budget(example), stops)
    report = json.loads(report_path.read_text())["no_fly_zones"]
    assert report["new_tokens"] == len(tokens) and report["tokens_per_forward"] == 1.0
    assert report["zone_exact_match"] == get_task("no_fly_zones").check(example.example, tokenizer.decode(tokens))["zone_exact_match"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(tmp_path / "peer"), "--messages", "0"])
    assert capsys.readouterr().err == "error: --messages must be at least 1, got 0\n"
