"""Answers that end under a grammar (issue 29), on the grammar alone: numbers of bounded digits, no key
written twice, no looping run, and an ending within the budget, at one token a step and in blocks of 16.
The "model" is a fixed ranking of tokens that walks into each run (`_decode`): no weights involved."""

import json
import re

import jsonschema
import pytest
import torch

from cloverlm.convert.load import load_folder_tokenizer
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.json_guard import LOOP_REPEATS, LOOP_SPAN, MAX_NUMBER_DIGITS
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.decoding.row import DecodeRow
from cloverlm.decoding.unmask import unmask
from cloverlm.tokenizer import MASK_TOKEN, stop_token_ids

ZONE = {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}, "radius_km": {"type": "number"}},
        "required": ["lat", "lon", "radius_km"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol():
    """The shipped model's tokenizer (SmolLM2's, with [MASK]): the issue's reproduction used it."""
    tokenizer = load_folder_tokenizer("models/smollm2-clover")
    return tokenizer, Grammars(tokenizer, len(tokenizer), stop_token_ids(tokenizer))


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _ranking(tokenizer, texts: list[str]) -> torch.Tensor:
    """Logits that rank the tokens of `texts` first, in order (one token each), all others far below."""
    logits = torch.full((len(tokenizer),), -20.0)
    for rank, text in enumerate(texts):
        [token] = _ids(tokenizer, text)
        logits[token] = 20.0 - rank
    return logits


def _decode(tokenizer, constraint, logits, block_size, max_new_tokens=64):
    """The engine's loop for one row (start_block, unmask, finish_block, next_block) with the same
    logits at every position; returns the finished row."""
    params = DecodeParams(max_new_tokens=max_new_tokens, block_size=block_size, threshold=0.9,
                          stop_token_ids=stop_token_ids(tokenizer))
    row = DecodeRow(Request([1], params, constraint=constraint), 0, tokenizer.convert_tokens_to_ids(MASK_TOKEN),
                    tokenizer.eos_token_id)
    row.start_block(block_size)
    for _ in range(10 * max_new_tokens):
        if unmask([row], logits.expand(1, len(row.block), -1), lookahead=True)[0]:
            row.finish_block(record=False)
            if row.finish_reason is not None:
                return row
            row.next_block(block_size, commit_in_place=False)
    raise AssertionError("the row never finished")


def test_a_number_cannot_continue_past_the_digit_cap(smol):
    tokenizer, grammars = smol
    constraint = grammars.constraint(grammars.json_schema(ZONE))
    for token in _ids(tokenizer, '{"lat":5.9'):
        constraint.advance(token)
    zero, comma = _ids(tokenizer, "0"), _ids(tokenizer, ",")
    for _ in range(MAX_NUMBER_DIGITS - 2):
        assert constraint.allows(zero[0])
        constraint.advance(zero[0])
    assert not constraint.allows(zero[0]) and constraint.allows(comma[0])
    allowed = constraint.allowed()
    texts = [tokenizer.decode([t]) for t in allowed.nonzero()[:, 0].tolist()]
    assert texts and all(text[0] not in "0123456789.eE+-" for text in texts)


@pytest.mark.parametrize("block_size", [1, 16])
def test_the_issue_example_closes_within_64_tokens(smol, block_size):
    """The reproduction of issue 29: a model that loves zeros wrote 5.970000… until the budget ran out."""
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["0", "5", ".", "9", "}"])
    constraint = grammars.constraint(grammars.json_schema(ZONE))
    row = _decode(tokenizer, constraint, logits, block_size)
    text = tokenizer.decode(row.generated)
    assert row.finish_reason == "stop" and len(row.generated) <= 64
    assert constraint.refused["guard"] > 0  # the digit cap turned the model's zero down
    jsonschema.validate(json.loads(text), ZONE)


def _no_repeated_keys(pairs):
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key written twice: {keys}"
    return dict(pairs)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_free_object_never_writes_a_key_twice_and_closes(smol, block_size):
    tokenizer, grammars = smol
    # the keys the model likes best are a few: it would write them again and again
    logits = _ranking(tokenizer, ['"', "use", "_", "upper", "case", "true", ":", ","])
    for grammar in (grammars.json_object(), grammars.json_schema({"type": "object", "properties": {"use_uppercase": {"type": "boolean"}}})):
        row = _decode(tokenizer, grammars.constraint(grammar), logits, block_size, max_new_tokens=128)
        text = tokenizer.decode(row.generated)
        assert row.finish_reason == "stop", text
        json.loads(text, object_pairs_hook=_no_repeated_keys)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_looping_string_is_cut_and_closed(smol, block_size):
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["free", "text", "_", '"'])
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"], "additionalProperties": False}
    row = _decode(tokenizer, grammars.constraint(grammars.json_schema(schema)), logits, block_size, max_new_tokens=256)
    note = json.loads(tokenizer.decode(row.generated))["note"]
    # LOOP_SPAN tokens of one repeated token make a loop: then the string may only close
    assert row.finish_reason == "stop" and note == "free" * LOOP_SPAN


def test_arrays_keep_max_items_and_close(smol):
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["1", ",", "]"])
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    row = _decode(tokenizer, grammars.constraint(grammars.json_schema(schema)), logits, 16)
    assert row.finish_reason == "stop" and len(json.loads(tokenizer.decode(row.generated))) <= 3


def test_a_budget_too_small_for_the_schema_still_ends_with_length(smol):
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["0", "5", ".", "9", "}"])
    row = _decode(tokenizer, grammars.constraint(grammars.json_schema(ZONE)), logits, 1, max_new_tokens=6)
    assert row.finish_reason == "length" and len(row.generated) == 6


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_looping_string_that_cannot_close_yet_must_write_something_else(smol, block_size):
    """Seen on a real schema: "size" with pattern ^[0-9]+x[0-9]+$ ran 6328800000… to the budget, since the
    quote that ends a loop was not allowed before the x."""
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["0", "x", "5", '"'])
    schema = {"type": "object", "properties": {"size": {"type": "string", "pattern": "^[0-9]+x[0-9]+$"}}, "required": ["size"],
              "additionalProperties": False}
    row = _decode(tokenizer, grammars.constraint(grammars.json_schema(schema)), logits, block_size, max_new_tokens=256)
    size = json.loads(tokenizer.decode(row.generated))["size"]
    assert row.finish_reason == "stop" and size.startswith("0" * LOOP_SPAN + "x") and len(row.generated) < 64


def test_formats_llguidance_does_not_know_are_dropped_as_annotations(smol):
    tokenizer, grammars = smol
    schema = {"type": "object", "properties": {"format": {"type": "string", "format": "path"}, "when": {"type": "string", "format": "date"}},
              "required": ["format", "when"], "additionalProperties": False}
    constraint = grammars.constraint(grammars.json_schema(schema))  # refused before: "Unknown format: path"
    for token in _ids(tokenizer, '{"format":"a/b","when":"'):
        assert constraint.allows(token)
        constraint.advance(token)
    assert not constraint.allows(_ids(tokenizer, "x")[0])  # the date format still holds


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_list_repeating_its_items_is_closed(smol, block_size):
    """Seen on a real schema: "beneficiary_country","beneficiary_country",… where one token (`","`) closes
    an item and opens the next, so the list is never seen between items."""
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["country", '","', '"]'])
    schema = {"type": "object", "properties": {"columns": {"type": "array", "items": {"type": "string"}}}, "required": ["columns"],
              "additionalProperties": False}
    constraint = grammars.constraint(grammars.json_schema(schema))
    prefix = '{"columns":["'
    for token in _ids(tokenizer, prefix):
        constraint.advance(token)
    row = _decode(tokenizer, constraint, logits, block_size, max_new_tokens=256)
    columns = json.loads(prefix + tokenizer.decode(row.generated))["columns"]
    # each item is a looping string (LOOP_SPAN times "country"), closed by `","`; LOOP_REPEATS such items
    # are a loop of the list (period LOOP_SPAN + 1 tokens), which closes after the item then opened
    assert row.finish_reason == "stop" and columns == ["country" * LOOP_SPAN] * (LOOP_REPEATS + 1)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_list_item_is_not_opened_where_it_cannot_close(smol, block_size):
    """Seen on the bench's grounded no_fly answers: with 2 tokens to close, 29 left, the model wrote `"},`
    and opened one more zone, whose ending (84 tokens) no longer fit. An item here is ~40 forced tokens;
    the model always prefers another one."""
    tokenizer, grammars = smol
    item = {"type": "object", "properties": {key: {"enum": ["value"]} for key in ("alpha", "bravo", "charlie", "delta", "echo",
                                                                                    "foxtrot", "golf", "hotel")},
            "required": ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"], "additionalProperties": False}
    schema = {"type": "array", "items": item}
    logits = _ranking(tokenizer, [",", "{", "]"])
    for budget in (150, 200, 230):
        row = _decode(tokenizer, grammars.constraint(grammars.json_schema(schema)), logits, block_size, max_new_tokens=budget)
        items = json.loads(tokenizer.decode(row.generated))
        assert row.finish_reason == "stop" and len(items) >= 2, (budget, len(items))


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("pattern", [r"^.*\.md$", r"\d{3}-[A-Z]{2}"])
def test_a_string_under_a_pattern_is_closed_by_a_short_match(smol, block_size, pattern):
    """Seen in the real-schema sweep: a `.md` path ran `pulumipulumi…` and a part number (unanchored
    `\\d{3}-[A-Z]{2}`) ran on to the limit: the quote was never allowed, and no ending was found."""
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["hello", "world"])
    schema = {"type": "object", "properties": {"path": {"type": "string", "pattern": pattern}}, "required": ["path"],
              "additionalProperties": False}
    row = _decode(tokenizer, grammars.constraint(grammars.json_schema(schema)), logits, block_size, max_new_tokens=64)
    path = json.loads(tokenizer.decode(row.generated))["path"]
    assert row.finish_reason == "stop" and re.search(pattern, path) and "hello" in path, path


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_value_is_not_cut_where_the_model_is_unsure_and_the_budget_has_room(smol, block_size):
    """Seen in the campaign's tool_call point (exact 0.15 at B = 16, 1.0 at B = 1): `"date":"202"`. Near
    its budget the grammar narrows its mask to the short ending's next token, the closing quote; masked
    to that one token the model looked sure of it, and the threshold rule closed the string at the
    first target the model was unsure of. Here the model is never sure of its digits (four at equal odds):
    the string goes on as at B = 1 (until the loop guard closes it), at every block size."""
    tokenizer, grammars = smol
    logits = torch.full((len(tokenizer),), -20.0)
    logits[[_ids(tokenizer, digit)[0] for digit in "2016"]] = 10.0
    schema = {"type": "object", "properties": {"date": {"type": "string"}, "units": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["date", "units"], "additionalProperties": False}
    row = _decode(tokenizer, grammars.constraint(grammars.json_schema(schema)), logits, block_size, max_new_tokens=40)
    answer = json.loads(tokenizer.decode(row.generated))
    assert row.finish_reason == "stop" and len(answer["date"]) >= 10, answer


def test_the_peer_does_not_take_the_budgets_ending_for_a_forced_token(smol, monkeypatch):
    """The same at the peer (convert/peer.py, jump-forward): the budget's one-token mask was taken for a
    token the grammar forces and written without asking the model (tool_call 0.2 exact, dates cut to "202")."""
    import cloverlm.convert.peer as peer

    tokenizer, grammars = smol
    logits = torch.full((len(tokenizer),), -20.0)
    logits[[_ids(tokenizer, digit)[0] for digit in "2016"]] = 10.0
    monkeypatch.setattr(peer._CachedReader, "__init__", lambda self, model: setattr(self, "forwards", 0))
    monkeypatch.setattr(peer._CachedReader, "read", lambda self, ids: logits)  # the model: always unsure
    model = torch.nn.Linear(1, 1)
    model.config = type("Config", (), {"vocab_size": len(tokenizer)})()
    schema = {"type": "object", "properties": {"date": {"type": "string"}, "units": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["date", "units"], "additionalProperties": False}
    out = peer.peer_generate_constrained(model, [1], grammars.constraint(grammars.json_schema(schema)), max_new_tokens=40,
                                         stop_ids=tuple(stop_token_ids(tokenizer)))  # fmt: skip
    answer = json.loads(tokenizer.decode(out.tokens))
    assert len(answer["date"]) >= 10, answer


def test_near_the_budget_the_models_next_choices_that_fit_stay_allowed(smol):
    """Near its budget, a mask too wide to check token by token was narrowed to the short ending's next
    token alone: where the model's own choice did not fit, the answer took the ending whatever the model
    preferred next. With the model's scores, its best choices that still leave room for an ending stay."""
    tokenizer, grammars = smol
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"], "additionalProperties": False}
    digit = _ids(tokenizer, "7")[0]
    scores = torch.full((len(tokenizer),), -20.0)
    scores[digit] = 10.0
    for budget, fits in ((10, True), (4, False)):
        constraint = grammars.constraint(grammars.json_schema(schema))
        constraint.limit(budget)
        for token in _ids(tokenizer, '{"note":"'):
            constraint.advance(token)
        # the string's ending, '"}', is one token: it fits after the digit where two tokens are left
        assert (budget - constraint.used >= 2) == fits
        assert not constraint.allowed()[digit]  # thousands of string tokens: only the ending's next
        assert bool(constraint.allowed(scores=scores)[digit]) == fits
        assert int(constraint.allowed(scores=scores).sum()) <= 1 + 16


@pytest.mark.parametrize("block_size", [1, 16])
def test_an_ending_a_token_was_let_in_on_is_not_lost(smol, block_size):
    """Near the budget a token is let in only where a short ending still fits after it, but the search
    for an ending is greedy: after the first "0" of the part number's shortest tail ("000-AA"), it found
    none (no tail starts "00-AA"), the budget stopped narrowing, and the answer ran to the limit. The
    model here prefers a dozen string tokens to any ending, one after another as the loop guard refuses
    each run: the answer still closes within its budget, with a match."""
    tokenizer, grammars = smol
    logits = _ranking(tokenizer, ["hello", "world", "!", "#", "$", "%", "&", "a", "b", "c", "d", "e"])
    schema = {"type": "object", "properties": {"part": {"type": "string", "pattern": r"\d{3}-[A-Z]{2}"}},
              "required": ["part"], "additionalProperties": False}
    row = _decode(tokenizer, grammars.constraint(grammars.json_schema(schema)), logits, block_size, max_new_tokens=64)
    part = json.loads(tokenizer.decode(row.generated))["part"]
    assert row.finish_reason == "stop" and re.search(r"\d{3}-[A-Z]{2}", part), part
