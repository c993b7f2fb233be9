"""Constrained decoding: the engine's constraint rule (leftmost run, forced tokens, stops) with a toy
grammar, llguidance JSON schemas (a random model still writes schema-valid JSON), tool-call grammars, and
Engine.cancel."""

import json

import jsonschema
import pytest
import torch

from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import GrammarError, Grammars
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.decoding.row import DecodeRow
from cloverlm.decoding.unmask import unmask
from cloverlm.model.config import ATTENTION
from cloverlm.serving.text import parse_tool_calls
from cloverlm.tokenizer import stop_token_ids
from conftest import tiny_model

# Twenty schemas covering the JSON-schema features clients use; lengths are bounded so that a random
# model (which never chooses to stop on its own) finishes well inside max_new_tokens.
SHORT = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": SHORT}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5}}, "required": ["x"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"unit": {"const": "celsius"}, "value": {"type": "integer", "minimum": -50, "maximum": 50}},
     "required": ["unit", "value"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}}, "required": ["date"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                              "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {"kind": {"enum": ["drone", "plane"]}, "id": {"type": "integer", "minimum": 1, "maximum": 8}},
     "required": ["kind", "id"], "additionalProperties": False},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 6}}, "required": ["note"], "additionalProperties": False},
    {"type": "array", "prefixItems": [SHORT, {"type": "boolean"}], "items": False, "minItems": 2},
    {"type": "object", "properties": {"zones": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                         "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}}}, "required": ["zones"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@example\\.com$"}}, "required": ["email"],
     "additionalProperties": False},
    {"$defs": {"slot": {"type": "integer", "minimum": 0, "maximum": 3}}, "type": "object",
     "properties": {"first": {"$ref": "#/$defs/slot"}, "second": {"$ref": "#/$defs/slot"}}, "required": ["first", "second"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": SHORT, "b": SHORT}, "required": ["a"], "additionalProperties": False},
    {"type": "null"},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599},
                                      "message": SHORT}, "required": ["status", "code", "message"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def grammars(tokenizer, random_model):
    return Grammars(tokenizer, random_model.config.vocab_size, stop_token_ids(tokenizer))


def _requests(tokenizer, grammars, schema, **params):
    prompt = tokenizer("Answer in JSON:", add_special_tokens=False)["input_ids"]
    grammar = grammars.json_schema(schema)
    return [
        Request(prompt, DecodeParams(max_new_tokens=200, stop_token_ids=stop_token_ids(tokenizer), seed=seed, **params),
                constraint=grammars.constraint(grammar))
        for seed in range(2)
    ]


def test_a_random_model_writes_schema_valid_json_for_every_schema(tokenizer, random_model, grammars):
    assert len(SCHEMAS) >= 20
    requests, schemas = [], []
    for index, schema in enumerate(SCHEMAS):
        # greedy with one commit per step, and sampled with parallel commits: both must stay valid
        params = dict(block_size=8, threshold=0.9) if index % 2 else dict(block_size=4, threshold=0.05, temperature=1.0)
        batch = _requests(tokenizer, grammars, schema, **params)
        requests += batch
        schemas += [schema] * len(batch)
    completions = Engine(random_model, max_batch_size=16).generate(requests)
    for completion, schema in zip(completions, schemas):
        text = tokenizer.decode(completion.tokens)
        assert completion.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_forced_tokens_cost_no_forward(tokenizer, random_model, grammars):
    """A const-heavy schema is mostly forced: far fewer forwards than tokens, even committing one per step."""
    schema = {"type": "object", "properties": {"greeting": {"const": "hello there, general kenobi"}, "n": {"enum": [1, 2]}},
              "required": ["greeting", "n"], "additionalProperties": False}
    [request] = _requests(tokenizer, grammars, schema, block_size=16, threshold=1.0)[:1]
    [completion] = Engine(random_model).generate([request])
    assert json.loads(tokenizer.decode(completion.tokens))["greeting"] == "hello there, general kenobi"
    assert completion.forwards <= len(completion.tokens) / 3


LONG_RUNS = {"type": "object", "properties": {
    "greeting": {"const": "hello there, general kenobi, you are a bold one"}, "note": {"type": "string", "pattern": "^[a-z ]{10,12}$"},
    "farewell": {"const": "so uncivilised, and yet here we are again"}, "word": {"type": "string", "pattern": "^[a-z]{6}$"}},
    "required": ["greeting", "note", "farewell", "word"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize("block_size", [1, 4])
def test_forced_runs_jump_forward_in_one_commit(tokenizer, grammars, block_size):
    """Jump-forward (attention layers, causal clean stream): a forced run a block long is committed with
    the next forward. At B = 1 every choice reads the same history either way: the same answer, greedy
    (its free strings would differ if the jump's keys stood a position off);
    at B = 4 the answer is the grammar's. Both take fewer forwards than filling blocks with the run."""
    model = tiny_model(vocab_size=len(tokenizer), layer_types=[ATTENTION] * 4, causal_clean_stream=True)
    done = {}
    for jump in (False, True):
        [request] = _requests(tokenizer, grammars, LONG_RUNS, block_size=block_size, threshold=1.0)[:1]
        engine = Engine(model, jump_forward=jump)
        assert engine.jumps == jump
        [done[jump]] = engine.generate([request])
        jsonschema.validate(json.loads(tokenizer.decode(done[jump].tokens)), LONG_RUNS)
        assert done[jump].finish_reason == "stop"
    assert done[True].forwards < done[False].forwards / 2
    if block_size == 1:
        assert done[True].tokens == done[False].tokens


def test_no_jump_forward_where_a_commit_is_a_block(tokenizer, random_model, grammars):
    """Memory layers fold commits in block by block: there forced runs fill blocks as before."""
    assert not Engine(random_model).jumps
    assert not Engine(tiny_model(vocab_size=len(tokenizer), layer_types=[ATTENTION] * 4)).jumps


class _Digits:
    """A toy constraint: exactly `count` digit tokens, the first one forced, then the end token."""

    def __init__(self, digit_ids, forced, end_id, vocab, count):
        self.digit_ids, self.forced_id, self.end_id, self.vocab, self.count = digit_ids, forced, end_id, vocab, count
        self.seen: list[int] = []

    def allowed(self, within_budget=True, scores=None):
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[[self.end_id] if len(self.seen) >= self.count else self.digit_ids] = True
        return mask

    def allows(self, token):
        return bool(self.allowed()[token])

    def advance(self, token):
        assert self.allowed()[token], "the engine committed a token the grammar forbids"
        self.seen.append(token)

    def forced(self):
        return [self.forced_id] if not self.seen else []

    def limit(self, tokens):
        pass

    def finished(self):
        return len(self.seen) >= self.count


@pytest.mark.parametrize("strategy", ["threshold", "low_confidence"])
def test_the_constraint_rule_with_a_toy_grammar(strategy):
    model = tiny_model()
    steps = []
    constraint = _Digits(list(range(20, 30)), 25, 0, model.config.vocab_size, 11)
    request = Request(
        [7, 8, 9], DecodeParams(max_new_tokens=40, block_size=8, threshold=0.01, strategy=strategy), constraint=constraint,
        on_step=lambda _, block: steps.append(block),
    )
    [completion] = Engine(model).generate([request])
    assert completion.tokens == constraint.seen and len(completion.tokens) == 11
    assert completion.tokens[0] == 25 and completion.finish_reason == "stop"
    for block in steps:  # filled positions are always a prefix of the block (the leftmost-run rule)
        filled = [token != 2 for token in block]
        assert filled == sorted(filled, reverse=True)


def test_invalid_schemas_are_refused(grammars):
    for schema in ({"type": "foo"}, {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}, [1, 2], {"minLength": "x"}):
        with pytest.raises(GrammarError):
            grammars.constraint(grammars.json_schema(schema))


def test_tool_call_grammar_and_parsing(tokenizer, random_model, grammars):
    tools = [("get_weather", {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bern"]}}, "required": ["city"],
                              "additionalProperties": False}),
             ("set_timer", {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 90}},
                            "required": ["minutes"], "additionalProperties": False})]
    prompt = tokenizer("call a tool", add_special_tokens=False)["input_ids"]
    for named in (tools[:1], tools[1:]):
        request = Request(prompt, DecodeParams(max_new_tokens=100, stop_token_ids=stop_token_ids(tokenizer)),
                          constraint=grammars.constraint(grammars.tool_calls(named, single=True)))
        [completion] = Engine(random_model).generate([request])
        content, calls = parse_tool_calls(tokenizer.decode(completion.tokens))
        assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == named[0][0]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), named[0][1])
    text = 'Sure.\n<tool_call>\n{"name":"a","arguments":{"x":1}}\n</tool_call>\n<tool_call>\n{"name":"b","arguments":{}}'
    content, calls = parse_tool_calls(text)
    assert content == "Sure.\n" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert parse_tool_calls("no call here") == ("no call here", [])


def test_cancel_drops_a_request_and_leaves_the_others_unchanged():
    model = tiny_model()
    params = DecodeParams(max_new_tokens=12, block_size=4, threshold=1.0)
    alone = Engine(model).generate([Request([5, 6, 7], params)])[0].tokens
    engine = Engine(model, max_batch_size=2)
    keep, drop, waiting = Request([5, 6, 7], params), Request([9, 10, 11, 12], params), Request([13], params)
    for request in (keep, drop, waiting):
        engine.submit(request)
    engine.step()
    assert len(engine.rows) == 2 and len(engine.waiting) == 1
    assert engine.cancel(drop) and engine.cancel(waiting) and not engine.cancel(waiting)
    assert len(engine.rows) == 1 and not engine.waiting and engine.cache.batch_size == 1
    done = engine.run()
    assert [c.tokens for c in done] == [alone]
    assert not engine.cancel(keep)


class _Counting:
    """A constraint wrapper counting full masks; with shortcut=False it never answers `allows`, so the
    engine decides every target under its full mask (the reference for the shortcut)."""

    def __init__(self, inner, shortcut: bool):
        self.inner, self.shortcut, self.masks = inner, shortcut, 0

    def allowed(self, within_budget=True, scores=None):
        self.masks += within_budget  # the grammar-alone mask of the same position is the one computed
        return self.inner.allowed(within_budget)

    def allows(self, token):
        return self.shortcut and self.inner.allows(token)

    def advance(self, token):
        self.inner.advance(token)

    def forced(self):
        return self.inner.forced()

    def limit(self, tokens):
        self.inner.limit(tokens)

    def finished(self):
        return self.inner.finished()


def _wrapped_requests(tokenizer, grammars, shortcut, **params):
    requests = []
    for index, schema in enumerate(SCHEMAS):
        threshold = (1e-5, 2e-4, 0.9)[index % 3]
        for request in _requests(tokenizer, grammars, schema, block_size=8, threshold=threshold, **params):
            request.constraint = _Counting(request.constraint, shortcut)
            requests.append(request)
    return requests


def test_the_grammar_shortcut_gives_the_tokens_of_masking_every_target(tokenizer, random_model, grammars):
    """Asking the grammar about the unconstrained choice first (cloverlm.decoding.unmask._constrained) changes
    no token, and computes fewer masks."""
    fast = _wrapped_requests(tokenizer, grammars, shortcut=True)
    reference = _wrapped_requests(tokenizer, grammars, shortcut=False)
    got = Engine(random_model, max_batch_size=16).generate(fast)
    want = Engine(random_model, max_batch_size=16).generate(reference)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.forwards for c in got] == [c.forwards for c in want]
    masks, reference_masks = sum(r.constraint.masks for r in fast), sum(r.constraint.masks for r in reference)
    assert masks < reference_masks, (masks, reference_masks)  # a random model is rarely grammar-valid by itself


def test_lookahead_keeps_every_answer_grammar_valid(tokenizer, random_model, grammars):
    """With unchecked choices right of the grammar's reach (Engine(lookahead=True)) every answer still
    validates: an unchecked choice stays only where the grammar allows it when it gets there."""
    requests = _wrapped_requests(tokenizer, grammars, shortcut=True)
    completions = Engine(random_model, max_batch_size=16, lookahead=True).generate(requests)
    for completion, schema in zip(completions, [s for s in SCHEMAS for _ in range(2)]):
        text = tokenizer.decode(completion.tokens)
        assert completion.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def _peaked(vocab, tokens):
    """Logits [n, V]: a sure choice where `tokens` names one, flat where it holds None."""
    logits = torch.zeros(len(tokens), vocab)
    for position, token in enumerate(tokens):
        if token is not None:
            logits[position, token] = 20.0
    return logits


def test_lookahead_keeps_unchecked_choices_the_grammar_allows_and_redecides_the_others():
    """The rule itself, on hand-made logits: step 1 decides 21 and stops at an unsure target; the sure
    choices right of it (22, 22, 40, 22, 22) wait. Step 2 decides 23, keeps the unchecked 22s and replaces
    the 40, which the grammar (digits 20..29) forbids, with its own choice there (24)."""
    vocab, mask = 64, 2
    constraint = _Digits(list(range(20, 30)), 25, 0, vocab, 8)
    row = DecodeRow(Request([7, 8], DecodeParams(block_size=8, threshold=0.5), constraint=constraint), 0, mask, 0)
    row.start_block(8)
    assert row.block.tolist() == [25] + [mask] * 7  # the forced first digit
    first = _peaked(vocab, [None, 21, None, 22, 22, 40, 22, 22])
    assert unmask([row], first[None], lookahead=True) == [False]
    assert row.block.tolist() == [25, 21, mask, 22, 22, 40, 22, 22]
    assert row.unchecked.tolist() == [False, False, False, True, True, True, True, True]
    second = _peaked(vocab, [None, None, 23, None, None, 24, None, None])
    assert unmask([row], second[None], lookahead=True) == [True]
    assert row.block.tolist() == [25, 21, 23, 22, 22, 24, 22, 22] and not row.unchecked.any()
    assert constraint.seen == row.block.tolist()
    # without lookahead only the leftmost run commits: the sure choices right of it stay masked
    leftmost = DecodeRow(Request([7, 8], DecodeParams(block_size=8, threshold=0.5),
                                 constraint=_Digits(list(range(20, 30)), 25, 0, vocab, 8)), 0, mask, 0)
    leftmost.start_block(8)
    assert unmask([leftmost], first[None], lookahead=False) == [False]
    assert leftmost.block.tolist() == [25, 21] + [mask] * 6 and not leftmost.unchecked.any()


def test_lookahead_in_a_block_narrower_than_the_batch():
    """A row whose block is cut short (its last block, at max_new_tokens) beside wider ones gets logits as
    wide as the widest block: only its own targets are decided or held."""
    vocab, mask = 64, 2
    constraint = _Digits(list(range(20, 30)), 25, 0, vocab, 8)
    row = DecodeRow(Request([7, 8], DecodeParams(block_size=8, threshold=0.5), constraint=constraint), 0, mask, 0)
    row.start_block(4)
    logits = _peaked(vocab, [None, 21, None, 22, 22, 22, 22, 22])  # 8 wide, the block 4
    assert unmask([row], logits[None], lookahead=True) == [False]
    assert row.block.tolist() == [25, 21, mask, 22] and row.unchecked.tolist() == [False, False, False, True]
