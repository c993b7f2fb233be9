"""The peer under the engine's grammar (issue 21): constrained greedy decoding and jump-forward (forced tokens
ride in one forward with the KV cache), on tiny Llamas and a tiny Qwen3.5 peer over the shipped tokenizer."""

import json

import pytest
import torch
import torch.nn.functional as F
from jsonschema import Draft202012Validator
from transformers import LlamaConfig, LlamaForCausalLM

from cloverlm import CloverError, preset_config
from cloverlm.convert.peer import build_peer, peer_config, peer_generate_constrained
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.grounding import without_grounding
from cloverlm.tasks import get_task
from cloverlm.tokenizer import stop_token_ids
from conftest import TINY

PROMPT = "List the active drone no-fly zones:"


def tiny_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def setup(tokenizer):
    """The tokenizer's grammars, its stop ids, the prompt's ids and a no_fly example with its schema."""
    stops = stop_token_ids(tokenizer)
    task = get_task("no_fly_zones")
    example = task.generate(1, n_messages=1)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    # the plain schema: PROMPT is not the example's, so grounded values would have nothing to copy
    return Grammars(tokenizer, len(tokenizer), stops), stops, prompt, example, without_grounding(task.answer_schema(example))


@pytest.fixture(scope="module")
def trained(tokenizer, setup):
    """A tiny Llama that has seen the example's answer after the prompt (60 steps, about a second): a random
    model writes numbers digit after digit forever, which no schema of JSON numbers can stop."""
    _, stops, prompt, example, _ = setup
    model = tiny_llama(len(tokenizer)).train()
    ids = torch.tensor([prompt + tokenizer(example.answer, add_special_tokens=False)["input_ids"] + [stops[-1]]])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(60):
        logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
        loss = F.cross_entropy(logits, ids[0, len(prompt) :])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def masked_greedy(model, prompt, constraint, max_new_tokens, stops) -> list[int]:
    """The reference: at each position the whole sequence again (no cache), argmax under the grammar's mask."""
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < max_new_tokens:
            allowed = constraint.allowed()
            logits = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0, -1]
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            if token in stops:
                break
            constraint.advance(token)
            tokens.append(token)
    return tokens


def test_the_peers_constrained_answer_validates(tokenizer, setup, trained):
    grammars, stops, prompt, _, schema = setup
    out = peer_generate_constrained(trained, prompt, grammars.constraint(grammars.json_schema(schema)), 200, stops)
    answer = json.loads(tokenizer.decode(out.tokens))
    Draft202012Validator(schema).validate(answer)
    assert len(answer) >= 1
    # One forward per choice of the model; the finished grammar ends the answer without one.
    assert out.forwards == len(out.tokens) - out.forced < len(out.tokens)
    assert out.forced > 0.3 * len(out.tokens)


@pytest.mark.parametrize("kind", ["trained llama", "random llama", "random qwen3.5 peer"])
def test_jump_forward_gives_token_by_token_constrained_greedy_in_fewer_forwards(tokenizer, setup, trained, kind):
    """Appending a forced run to the cache in one forward reads as appending it token by token (the
    Qwen3.5 peer's linear layers carry their conv and recurrent state across it), and taking the forced
    tokens without the model is what greedy under the mask would do."""
    grammars, stops, prompt, _, schema = setup
    if kind == "trained llama":
        model = trained
    elif kind == "random llama":
        model = tiny_llama(len(tokenizer), seed=1)
    else:
        torch.manual_seed(0)
        model = build_peer(peer_config(preset_config("clover-tiny", **{**TINY, "vocab_size": len(tokenizer)}))).eval()
    grammar = grammars.json_schema(schema)
    budget = 60 if "qwen" in kind else 120  # the random models never finish; the peer is slower per forward

    def unbudgeted():  # the grammar alone: budget-aware closing (tested in test_json_guard.py) left out
        constraint = grammars.constraint(grammar)
        constraint.limit = lambda tokens: None
        return constraint

    jump = peer_generate_constrained(model, prompt, unbudgeted(), budget, stops)
    plain = peer_generate_constrained(model, prompt, unbudgeted(), budget, stops, jump_forward=False)
    assert jump.tokens == plain.tokens == masked_greedy(model, prompt, unbudgeted(), budget, stops)
    assert jump.forced == plain.forced > 0
    assert jump.forwards < plain.forwards


def test_a_grammar_of_one_string_costs_no_choice(tokenizer, setup, trained):
    grammars, stops, prompt, example, _ = setup
    expected = tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    for jump_forward in (True, False):
        constraint = grammars.constraint(grammars.json_schema({"const": example.truth}))
        out = peer_generate_constrained(trained, prompt, constraint, 200, stops, jump_forward=jump_forward)
        assert out.tokens == expected
        # Nothing to choose: not even the prompt needs reading.
        assert (out.forwards, out.forced) == (0, len(expected))


def test_forced_runs_between_choices_ride_in_the_next_forward(tokenizer, setup, trained):
    """Two choices (the unit, the lower limit) among constants: two forwards, whatever the length."""
    grammars, stops, prompt, example, _ = setup
    zone = example.truth[0]
    properties = {key: {"const": value} for key, value in zone.items()}
    properties |= {"unit": {"enum": ["NM", "KM"]}, "lower": {"enum": ["SFC", "100FT"]}}
    schema = {"type": "object", "properties": properties, "required": list(zone), "additionalProperties": False}
    constraint = grammars.constraint(grammars.json_schema(schema))
    out = peer_generate_constrained(trained, prompt, constraint, 200, stops)
    assert Draft202012Validator(schema).is_valid(json.loads(tokenizer.decode(out.tokens)))
    assert out.forwards == len(out.tokens) - out.forced == 2


def test_constrained_decoding_errors(tokenizer, setup):
    grammars, stops, prompt, _, schema = setup
    grammar = grammars.json_schema(schema)
    with pytest.raises(CloverError, match="stop_ids"):
        peer_generate_constrained(tiny_llama(len(tokenizer)), prompt, grammars.constraint(grammar), 10)
    with pytest.raises(CloverError, match="the grammar has"):
        peer_generate_constrained(tiny_llama(len(tokenizer) + 8), prompt, grammars.constraint(grammar), 10, stops)
    with pytest.raises(CloverError, match="empty prompt"):
        peer_generate_constrained(tiny_llama(len(tokenizer)), [], grammars.constraint(grammar), 10, stops)
