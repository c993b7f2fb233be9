"""Grammar constraints for the engine, compiled by llguidance: JSON schemas, any JSON object, tool calls.

`Grammars` is built once per tokenizer (llguidance's token trie takes ~0.1 s); each request gets its own
`GrammarConstraint` (the engine's `Constraint` protocol), a matcher advanced over the tokens it commits.
JSON is compact (no free whitespace): that is how the training answers are written, and a grammar that
allowed blanks would let a weak model pad forever.
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

from cloverlm.errors import CloverError
from cloverlm.tokenizer import MASK_TOKEN, PAD_TOKEN, TOOL_CALL_END, TOOL_CALL_START

COMPACT = {"whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)


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

    def json_schema(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as error:
            raise GrammarError(f"invalid JSON schema: {error.message}") from None
        except RecursionError:
            raise GrammarError("invalid JSON schema: nested too deeply") from None
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
            raise GrammarError(f"unsupported or invalid schema: {matcher.get_error()}")
        return GrammarConstraint(matcher, self)


class GrammarConstraint:
    """One request's grammar state (the engine's `Constraint`)."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars):
        self.matcher = matcher
        self.grammars = grammars
        self.end_mask = torch.zeros(grammars.vocab_size, dtype=torch.bool)
        self.end_mask[grammars.end_ids] = True
        self.words = torch.zeros(llguidance.torch.get_bitmask_shape(1, grammars.lltokenizer.vocab_size)[1], dtype=torch.int32)

    def copy(self) -> GrammarConstraint:
        """The same grammar in its current state, for another choice of the same request (n > 1)."""
        return GrammarConstraint(self.matcher.deep_copy(), self.grammars)

    def allowed(self) -> torch.Tensor:
        if self.matcher.is_stopped():  # finished (or failed): only an end token may follow
            return self.end_mask
        # llguidance writes the mask as int32 words, bit i of word w standing for token 32w + i
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * self.words.element_size())
        allowed = ((self.words[:, None] >> _BITS) & 1).bool().flatten()
        mask = torch.zeros(self.grammars.vocab_size, dtype=torch.bool)
        width = min(len(allowed), self.grammars.vocab_size)
        mask[:width] = allowed[:width]
        mask[self.grammars.banned] = False
        return mask if bool(mask.any()) else self.end_mask

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, without computing the whole mask (a walk of its bytes)."""
        if self.matcher.is_stopped():
            return bool(self.end_mask[token])
        if token in self.grammars.banned or token >= self.grammars.lltokenizer.vocab_size:
            return False
        return self.matcher.validate_tokens([token]) == 1

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    def forced(self) -> list[int]:
        return [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()
