"""Grammar constraints for the engine, compiled by llguidance: JSON schemas, any JSON object, tool calls.

`Grammars` is built once per tokenizer (llguidance's token trie takes ~0.1 s); each request gets its own
`GrammarConstraint` (the engine's `Constraint` protocol), a matcher advanced over the tokens it commits.
JSON is compact (no free whitespace): that is how the training answers are written, and a grammar that
allowed blanks would let a weak model pad forever. For the same reason every constraint applies the
rules of `json_guard` beside the grammar (numbers of bounded digits, no key twice, no looping run), and
one given a budget (`limit`) closes within it: when the tokens left come down to what a short ending
of the grammar needs, it allows only tokens after which such an ending still fits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from jsonschema import Draft202012Validator, SchemaError

from cloverlm.decoding.grounding import GroundingError, ground, is_grounded, without_keys
from cloverlm.decoding.json_guard import JsonState, VocabTable
from cloverlm.decoding.patterns import string_tails
from cloverlm.errors import CloverError
from cloverlm.tokenizer import MASK_TOKEN, PAD_TOKEN, TOOL_CALL_END, TOOL_CALL_START

COMPACT = {"whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)
# Budget-aware closing: a short ending is looked for every RECHECK tokens, and at every token once the
# tokens left are within WATCH of its length; from then on a choice must leave room for an ending. (With
# the watch only at the last tokens, a model that opened one more no_fly zone 60 tokens before the end
# found its ending, 85 tokens, longer than the budget: 35-55% of answers were cut.) An ending is
# looked for up to MAX_ENDING tokens (deeper ones are not closed early). A short ending prefers these
# token texts: closers, then a comma (a required key comes forced after it), then the shortest values.
RECHECK, WATCH, MAX_ENDING, CHECK_AT_MOST = 8, 24, 128, 16
# The string formats llguidance enforces. A format is an annotation in JSON Schema 2020-12 (validators do
# not assert it by default), so any other format is dropped before compiling rather than refused (seen:
# "path" and "partial-date" in real-world schemas).
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid", "unknown"})
_ENDING_TEXTS = [b'"}]', b'"]}', b'"}}', b'"]]', b'"}', b'"]', b'}]', b']}', b'}}', b']]', b'}', b']', b'"',
                 b",", b"1", b"0", b"[]", b"{}", b"null", b"true", b"false", b'""']


class GrammarError(CloverError):
    """A schema or grammar that cannot be compiled (the caller's input, not a server fault)."""


def tool_call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON body of one `<tool_call>`: {"name": name, "arguments": {...}}, as the chat template writes it."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


class Grammars:
    """Compiles grammars for one tokenizer and model vocabulary.

    end_ids: the tokens that end a generation (they are what a finished grammar allows; the engine must
    treat them as stops). The [MASK] and pad tokens are never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int, end_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.end_ids = list(end_ids)
        self.lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=self.end_ids)
        self.banned = [tokenizer.convert_tokens_to_ids(t) for t in (MASK_TOKEN, PAD_TOKEN)]
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        # The tool-call markers are special tokens in Clover's own tokenizer, plain text in a converted
        # base's (SmolLM2 has none): lark writes the first bare, the second as a string.
        added = set(tokenizer.get_added_vocab())
        self.tool_markers = [m if m in added else json.dumps(m) for m in (TOOL_CALL_START, TOOL_CALL_END)]
        token_bytes = [self.lltokenizer.decode_bytes([t]) for t in range(self.lltokenizer.vocab_size)]
        self.table = VocabTable(token_bytes, vocab_size)
        first_id = {}
        for token, data in enumerate(token_bytes):
            first_id.setdefault(data, token)
        # inside a string a closer is text: there only tokens that close the string end it
        ids = [(text, first_id[text]) for text in _ENDING_TEXTS if text in first_id]
        self.ending_order = {True: [t for text, t in ids if text.startswith(b'"') and text != b'""'],
                             False: [t for text, t in ids if not text.startswith(b'"') or text == b'""']}
        self.end_mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.end_mask[self.end_ids] = True
        self.words = torch.zeros(llguidance.torch.get_bitmask_shape(1, self.lltokenizer.vocab_size)[1], dtype=torch.int32)

    def json_schema(self, schema: Any, prompt: str | None = None) -> str:
        """The grammar of `schema`; a schema with grounded fields (`decoding.grounding`) needs the prompt
        text its values are taken from."""
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as error:
            raise GrammarError(f"invalid JSON schema: {error.message}") from None
        except RecursionError:
            raise GrammarError("invalid JSON schema: nested too deeply") from None
        schema = _known_formats(schema)
        if is_grounded(schema):
            if prompt is None:
                raise GrammarError("a schema with x-grounded fields needs the prompt its values come from")
            try:
                schema = ground(schema, prompt)
            except GroundingError as error:
                raise GrammarError(str(error)) from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)

    def json_object(self) -> str:
        return self.json_schema({"type": "object"})

    def tool_calls(self, tools: Sequence[tuple[str, dict[str, Any] | None]], single: bool) -> str:
        """One `<tool_call>` (single) or several, each calling one of `tools` (name, parameters schema)."""
        for _, parameters in tools:
            if parameters is not None:
                self.json_schema(parameters)  # a clear error for a bad tool schema, before the grammar's
        body = {"anyOf": [tool_call_schema(name, parameters) for name, parameters in tools], "x-guidance": COMPACT}
        opener, closer = self.tool_markers
        call = f'{opener} "\\n" %json {json.dumps(body)} "\\n" {closer}'
        start = "call" if single else 'call ("\\n" call)*'
        return llguidance.LLMatcher.grammar_from_lark(f"start: {start}\ncall: {call}\n")

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh matcher for one request; GrammarError if the grammar does not compile."""
        try:
            matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self.limits)
        except (ValueError, RuntimeError) as error:  # API-level misuse; grammar errors come as is_error
            raise GrammarError(f"cannot compile the grammar: {error}") from None
        if matcher.is_error():
            raise GrammarError(_refusal(matcher.get_error()))
        return GrammarConstraint(matcher, self, JsonState(self.table), string_tails(grammar, self.lltokenizer.tokenize_str))

    def mask(self, matcher: llguidance.LLMatcher, state: JsonState) -> torch.Tensor:
        """Bool [vocab] of the tokens the grammar and the rules of `json_guard` allow next (the grammar's
        alone where the rules would leave nothing; only end tokens where nothing is left)."""
        if matcher.is_stopped():  # finished (or failed): only an end token may follow
            return self.end_mask
        # llguidance writes the mask as int32 words, bit i of word w standing for token 32w + i
        matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * self.words.element_size())
        allowed = ((self.words[:, None] >> _BITS) & 1).bool().flatten()
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        width = min(len(allowed), self.vocab_size)
        mask[:width] = allowed[:width]
        mask[self.banned] = False
        for forbidden in (state.forbidden(), state.loop_fallback()):
            if forbidden is not None and bool((mask & ~forbidden).any()):
                mask &= ~forbidden
                break
        return mask if bool(mask.any()) else self.end_mask

    def ending(self, matcher: llguidance.LLMatcher, state: JsonState, limit: int, tails: Sequence[list[int]] = ()) -> list[int] | None:
        """A short sequence of tokens after which the grammar accepts (forced runs, then closers, commas
        and the shortest values; in a string that cannot close yet, the first of `tails` (a pattern's
        shortest endings, decoding/patterns.py) the grammar takes; else the longest token allowed); None
        if none is found within `limit`."""
        matcher, state, out = matcher.deep_copy(), state.copy(), []
        while not matcher.is_accepting():
            if len(out) >= limit or matcher.is_stopped():
                return None
            run = matcher.compute_ff_tokens()
            if not run:  # token checks, not a mask: a mask of the whole vocabulary costs ~100x one check
                order = self.ending_order[state.in_string]
                run = [next((t for t in order if matcher.validate_tokens([t]) == 1 and not state.forbids(t)), None)]
                if run[0] is None and state.in_string:
                    run = next((tail for tail in tails if matcher.validate_tokens(tail) == len(tail)), run)
                if run[0] is None:
                    run = [int((self.table.length * self.mask(matcher, state)).argmax())]
            for token in run:
                matcher.consume_token(token)
                state.feed(token)
            out += run
        return out if len(out) <= limit else None


def _known_formats(schema: Any) -> Any:
    """`schema` without the string formats llguidance does not know (FORMATS)."""
    return without_keys(schema, lambda key, value: key == "format" and isinstance(value, str) and value not in FORMATS)


def _refusal(error: str) -> str:
    """Why a schema is refused. Keywords no grammar here enforces (an overlapping oneOf, uniqueItems,
    not, if/then/else, dependentRequired) are refused rather than served: an answer decoded without
    them could break them, and a strict schema promises that it cannot (docs/design.md, 4b)."""
    if "oneOf" in error:
        return ("unsupported schema: a oneOf whose branches can overlap (a grammar cannot enforce that exactly one "
                "matches; llguidance proves only some branches exclusive, such as branches of different types): write anyOf")
    if "Unimplemented keys" in error:
        keys = error[error.index("Unimplemented keys"):].split(":", 1)[1].strip()
        return f"unsupported schema: the keywords {keys} are not enforced by this server's grammar; drop them to get answers without them"
    return f"unsupported or invalid schema: {error}"


class GrammarConstraint:
    """One request's grammar state (the engine's `Constraint`)."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars, state: JsonState, tails: list[list[int]]):
        self.matcher = matcher
        self.grammars = grammars
        self.state = state
        self.tails = tails  # how a string under one of the schema's patterns may end (decoding/patterns.py)
        self.budget: int | None = None
        self.used = 0
        self.refused = {"guard": 0, "budget": 0}  # model choices the grammar allowed but these rules did not
        self._ending: list[int] | None = None
        self._ending_at = -RECHECK  # when `_ending` was looked for (in tokens used)
        # Endings proven at this position, by the token they follow (`_fits_after`): the search is greedy
        # and may miss, from the state a token leads to, the ending that token was let in on (after the
        # first "0" of a pattern's "000-AA" tail no tail starts "00-AA", and the answer ran to the limit).
        # So `advance` keeps the ending a token was let in on, or the rest of the ending it begins.
        self._proven: dict[int, list[int]] = {}
        self._mask: torch.Tensor | None = None
        self._mask_at = -1  # the grammar's mask and when it was computed (in tokens used)

    def copy(self) -> GrammarConstraint:
        """The same grammar in its current state, for another choice of the same request (n > 1)."""
        other = GrammarConstraint(self.matcher.deep_copy(), self.grammars, self.state.copy(), self.tails)
        other.budget, other.used = self.budget, self.used
        return other

    def limit(self, tokens: int) -> None:
        self.budget = tokens

    def finished(self) -> bool:
        return self.matcher.is_accepting()

    def allowed(self, within_budget: bool = True, scores: torch.Tensor | None = None) -> torch.Tensor:
        """The grammar's mask; once the budget comes within WATCH tokens of a short ending, only tokens
        after which such an ending fits: the ending's next token, and those of the mask that fit, all of
        them where the mask is small, else the CHECK_AT_MOST best by `scores` that score above the
        ending's token (the model's, when given: where its own choice was refused, its next ones rather
        than the ending's token alone). `allows` accepts any token that fits, so the engine's greedy
        choice keeps its own way to close where it has room (it asks `allows` first). Before the watch, near the budget, a few openers that would
        leave no room are taken out (`_checks_openers`). within_budget=False: the grammar's mask alone,
        which the engine measures the model's confidence against."""
        if self._mask_at != self.used:  # the engine may ask twice at one position (see within_budget)
            self._mask, self._mask_at = self.grammars.mask(self.matcher, self.state), self.used
        mask = self._mask
        if not within_budget:
            return mask
        ending = self._near_ending()
        if ending is None:
            if self._checks_openers():
                openers = (mask & self.grammars.table.opens).nonzero()[:, 0].tolist()
                if len(openers) <= CHECK_AT_MOST:
                    fitting = mask.clone()
                    fitting[[token for token in openers if not self._fits_after(token)]] = False
                    return fitting if bool(fitting.any()) else mask
            return mask
        near = torch.zeros_like(mask)
        near[ending[0]] = True
        candidates = mask.nonzero()[:, 0]
        if len(candidates) > CHECK_AT_MOST:
            if scores is None:
                return near
            # only those the model prefers to the ending's token (a grammar's vocabulary may outnumber the model's)
            ranked = candidates[candidates < len(scores)]
            ranked = ranked[scores[ranked] > scores[ending[0]]] if ending[0] < len(scores) else ranked
            candidates = ranked[scores[ranked].float().topk(min(CHECK_AT_MOST, len(ranked))).indices]
        for token in candidates.tolist():
            near[token] = near[token] or self._fits_after(token)
        return near

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, without computing the whole mask (a walk of its bytes)."""
        if self.matcher.is_stopped():
            return bool(self.grammars.end_mask[token])
        if token in self.grammars.banned or token >= self.grammars.lltokenizer.vocab_size:
            return False
        if self.matcher.validate_tokens([token]) != 1:
            return False
        if self.state.forbids(token):
            self.refused["guard"] += 1
            return False
        ending = self._near_ending()
        if ending is None:
            fits = not (self._checks_openers() and bool(self.grammars.table.opens[token])) or self._fits_after(token)
        else:
            fits = token == ending[0] or self._fits_after(token)
        if not fits:
            self.refused["budget"] += 1
        return fits

    def advance(self, token: int) -> None:
        proven = self._proven.get(token)
        if self._ending and self._ending_at == self.used and token == self._ending[0]:
            proven = self._ending[1:]
        self._proven = {}
        self.matcher.consume_token(token)
        self.state.feed(token)
        self.used += 1
        if proven is not None:
            self._ending, self._ending_at = proven, self.used

    def forced(self) -> list[int]:
        return [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()

    def _near_ending(self) -> list[int] | None:
        """The short ending to keep room for, once the budget is within WATCH tokens of it; else None."""
        if not self._checks_openers():  # no ending found (at most MAX_ENDING tokens) could be near yet
            return None
        left = self.budget - self.used
        near = self._ending is not None and left <= len(self._ending) + WATCH
        if (near or self.used - self._ending_at >= RECHECK) and self._ending_at != self.used:
            self._ending = self.grammars.ending(self.matcher, self.state, min(left, MAX_ENDING), self.tails)
            self._ending_at = self.used
        if self._ending is None or left > len(self._ending) + WATCH or not self._ending:
            return None
        return self._ending

    def _checks_openers(self) -> bool:
        """Whether a token that opens an element must show that an ending still fits after it: once the
        budget is within MAX_ENDING + WATCH. The watch is measured from the current short ending, which
        an opener can outgrow at once (a no_fly zone opened 29 tokens before the budget, with 2 to close
        and 84 after the comma, ran to the limit)."""
        return self.budget is not None and self.budget - self.used <= MAX_ENDING + WATCH

    def _fits_after(self, token: int) -> bool:
        """Whether a short ending still fits in the budget after `token`."""
        matcher, state = self.matcher.deep_copy(), self.state.copy()
        if matcher.consume_token(token) is False:
            return False
        state.feed(token)
        ending = self.grammars.ending(matcher, state, self.budget - self.used - 1, self.tails)
        if ending is not None:
            self._proven[token] = ending
        return ending is not None
