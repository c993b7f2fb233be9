"""Draft-filled blocks (cloverlm.decoding.draft and the engine's use of it) and the batched threshold rule."""

import pytest
import torch

from cloverlm import CloverCache, CloverError
from cloverlm.decoding.draft import PromptLookup
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.decoding.unmask import threshold_accept
from cloverlm.model.config import ATTENTION
from conftest import tiny_model

MASK = 2


def all_attention(**overrides):
    return tiny_model(layer_types=[ATTENTION] * 4, causal_clean_stream=True, mlp_type="dense", intermediate_size=64, **overrides)


def prompt(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (length,), generator=g).tolist()


def test_prompt_lookup_continues_the_longest_latest_match():
    lookup = PromptLookup([5, 6, 7, 8, 9, 6, 7, 1, 2, 3])
    assert lookup.propose([6, 7], 3) == [1, 2, 3]  # the latest "6 7" wins over the first
    assert lookup.propose([5, 6, 7], 2) == [8, 9]  # a 3-gram beats the 2-gram "6 7"
    assert lookup.propose([42], 4) == []  # no match: no draft
    lookup.extend([6, 7, 4])
    assert lookup.propose([6, 7], 2) == [4]  # committed text joins the index; the draft stops at its end


def test_a_position_never_reads_a_draft_after_it():
    """The causal draft mask: changing the draft at input slot s changes no logits before s, though
    masked slots between could carry it back through the layers (they are causal too)."""
    model = all_attention()
    ids = torch.tensor([prompt(20, 1)])
    step = torch.tensor([[17, 40, 41, 42, MASK, MASK, 43, 44]])
    drafts = torch.tensor([[False, True, True, True, True, True, True, True]])  # from the first draft on
    with torch.no_grad():
        outputs = []
        for change in (0, 1):
            cache = CloverCache.empty(model.config)
            model.prefill(ids, [20], cache)
            ids_now = step.clone()
            ids_now[0, 3] += change * 100  # a different draft at slot 3
            outputs.append(model.decode(cache, step_ids=ids_now, step_causal=drafts).logits)
    torch.testing.assert_close(outputs[0][0, :3], outputs[1][0, :3], rtol=0, atol=0)
    assert not torch.equal(outputs[0][0, 3:], outputs[1][0, 3:])


def test_one_token_blocks_take_no_draft(monkeypatch):
    """At block size 1 draft=True is the plain path: no lookup is built, no step reads a draft (callers
    pass their draft setting at every block size and rely on this)."""
    model = all_attention()
    repeating = prompt(12, 3) * 3  # every n-gram recurs: a lookup would always propose
    requests = lambda draft: [Request(repeating, DecodeParams(max_new_tokens=12, block_size=1, draft=draft))]
    plain = Engine(model).generate(requests(False))
    monkeypatch.setattr(PromptLookup, "propose", lambda self, suffix, length: pytest.fail("a one-token block asked for a draft"))
    drafted = Engine(model).generate(requests(True))
    assert [(c.tokens, c.forwards) for c in drafted] == [(c.tokens, c.forwards) for c in plain]


def test_drafts_that_never_match_decode_as_plain(monkeypatch):
    """With the lookup finding nothing, draft=True takes exactly the plain path (tokens and forwards)."""
    model = all_attention()
    requests = lambda draft: [Request(prompt(n, n), DecodeParams(max_new_tokens=20, block_size=8, threshold=0.2, draft=draft)) for n in (9, 30)]
    plain = Engine(model).generate(requests(False))
    monkeypatch.setattr(PromptLookup, "propose", lambda self, suffix, length: [])
    drafted = Engine(model).generate(requests(True))
    assert [(c.tokens, c.forwards) for c in drafted] == [(c.tokens, c.forwards) for c in plain]


def test_confirmed_drafts_give_the_greedy_tokens():
    """A model that has learnt to copy: draft = its own greedy continuation, so a whole block is one
    forward. Built by decoding once without drafts, then prompting with that answer repeated."""
    model = all_attention()
    base = prompt(12, 3)
    params = DecodeParams(max_new_tokens=8, block_size=1)
    answer = Engine(model).generate([Request(base, params)])[0].tokens
    # The continuation of base is `answer`; put base + answer in the prompt, then base again.
    repeated = base + answer + base
    greedy = Engine(model).generate([Request(repeated, params)])[0].tokens
    with_drafts = Engine(model).generate(
        [Request(repeated, DecodeParams(max_new_tokens=8, block_size=8, threshold=1e-9, draft=True))]
    )[0]
    # threshold ~0 accepts every eligible position: the confirmed drafts up to the first disagreement
    eligible = next((i for i, (a, b) in enumerate(zip(greedy, answer)) if a != b), len(answer))
    assert with_drafts.tokens[: eligible + 1] == greedy[: eligible + 1]


def test_drafts_need_the_threshold_rule_and_an_all_attention_model():
    with pytest.raises(CloverError, match="threshold rule"):
        DecodeParams(draft=True, strategy="low_confidence").validate(16)
    with pytest.raises(CloverError, match="all-attention"):
        Engine(tiny_model()).submit(Request(prompt(5), DecodeParams(draft=True)))


def test_the_batched_rule_gives_the_host_rule_tokens():
    """Device-side unmasking (all greedy rows at once) against the row-by-row host rule it replaces."""
    model = all_attention()
    requests = lambda: [
        Request(prompt(21, 1), DecodeParams(max_new_tokens=20, block_size=8, threshold=0.3)),
        Request(prompt(5, 2), DecodeParams(max_new_tokens=17, block_size=4, threshold=1.0)),
        Request(prompt(40, 3), DecodeParams(max_new_tokens=9, block_size=16, threshold=0.05, max_steps=3)),
        Request(prompt(30, 4), DecodeParams(max_new_tokens=24, block_size=8, threshold=0.1, draft=True)),
    ]
    host = Engine(model, batched_unmask=False).generate(requests())
    batched = Engine(model).generate(requests())
    assert [(c.tokens, c.forwards) for c in batched] == [(c.tokens, c.forwards) for c in host]


def test_threshold_accept():
    confidence = torch.tensor([[0.2, 0.95, 0.5, 0.99], [0.1, 0.3, 0.2, 0.0]])
    open_ = torch.tensor([[True, True, True, False], [True, True, True, True]])
    accept = threshold_accept(confidence, open_, 0.9, torch.tensor([False, False]))
    assert accept.tolist() == [[False, True, False, False], [False, True, False, False]]  # always the best open one
    assert threshold_accept(confidence, open_, 0.9, torch.tensor([False, True]))[1].all()  # the last step: all open
    assert not threshold_accept(confidence, torch.zeros_like(open_), 0.9, False).any()


def test_blocks_committed_in_place_decode_as_recomputed():
    """A finished block whose last step ran as its commit would keeps the keys that step wrote (no
    commit forward): block size 1 still gives the greedy tokens of full recomputation, and drafted
    blocks the tokens of a cache rebuilt from scratch."""
    model = all_attention()
    ids = prompt(14, 6)
    with torch.no_grad():
        expected, sequence = [], list(ids)
        for _ in range(10):
            cache = CloverCache.empty(model.config)
            model.prefill(torch.tensor([sequence[:-1]]), [len(sequence) - 1], cache)
            token = int(model.decode(cache, step_ids=torch.tensor([[sequence[-1]]])).logits[0, -1].argmax())
            expected.append(token)
            sequence.append(token)
    completion = Engine(model).generate([Request(ids, DecodeParams(max_new_tokens=10, block_size=1))])[0]
    assert completion.tokens == expected and completion.forwards == 10
