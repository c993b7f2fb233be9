"""What a JSON grammar cannot say, enforced beside it: answers that end (issue 29).

llguidance's JSON grammar is exact about syntax and schema, but three runs stay legal forever: a
number's digits (`5.9700000…`), a key written again in an object whose keys are free
(`"use_uppercase":true,"use_uppercase":true,…`), and a string or array that repeats the same few
tokens (`freetext_freetext_…`). A weak model walks into each of them and never closes.

`JsonState` follows the JSON text committed so far (a small lexer: the open containers, whether a
string is open and whether it is a key, the digits of the number being written, the keys of each open
object, the tokens committed). `JsonState.forbidden` names the tokens that would continue one of the
three runs; the grammar's constraint takes them out of its mask (unless nothing else would be left).

`VocabTable` holds what the rules need to know about every token's bytes, computed once per tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A double prints in at most 17 significant digits and an int64 in 19: no number needs more, so a
# number that has 19 can only end.
MAX_NUMBER_DIGITS = 19
# A string or array is looping when its last tokens repeat a period of at most LOOP_PERIOD tokens at
# least LOOP_REPEATS times, over at least LOOP_SPAN tokens of it. A looping string may only close (or,
# where its pattern cannot close yet, go on with any token but the loop's); a looping array may only
# close after the element being written (a model that is refused one repeat starts the same run again:
# seen). docs/design.md (4b) gives what it costs on answers that do not loop.
LOOP_PERIOD = 16
LOOP_REPEATS = 3
LOOP_SPAN = 12

_NUMBER = frozenset(b"0123456789.eE+-")
_DIGITS = frozenset(b"0123456789")


class VocabTable:
    """Per token: its bytes, the digits its leading run of number characters holds, and (for tokens
    with a quote) the bytes before their first quote, which end a key being written."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        self.vocab_size = vocab_size
        self.token_bytes = token_bytes
        lead_digits, starts_number, self.key_ends, self.whole_keys = [0] * vocab_size, [False] * vocab_size, [], []
        for token, data in enumerate(token_bytes[:vocab_size]):
            run = 0
            while run < len(data) and data[run] in _NUMBER:
                run += 1
            if run:
                starts_number[token] = True
                lead_digits[token] = sum(byte in _DIGITS for byte in data[:run])
            quote = data.find(b'"')
            if quote >= 0 and b"\\" not in data[:quote]:
                self.key_ends.append((token, data[:quote]))
            if quote == 0 and b'"' in data[1:] and b"\\" not in data:  # a whole key in one token: `""`, `"id"`
                self.whole_keys.append((token, data[1: data.index(b'"', 1)]))
        self.starts_number = torch.tensor(starts_number)
        self.starts_quote = self._flags(lambda data: data[:1] == b'"')
        self.starts_comma = self._flags(lambda data: data[:1] == b",")
        # tokens that close a string and go on to the next element (`","` is one token in SmolLM2's vocabulary)
        self.closes_then_comma = self._flags(lambda data: data[:1] == b'"' and data.lstrip(b'"')[:1] == b",")
        # tokens that may open an element (one more list item or key, a new container): the only ones after
        # which the shortest ending can grow by more than a few tokens (decoding/grammar.py's budget)
        self.opens = self._flags(lambda data: any(byte in b",{[" for byte in data))
        self.lead_digits = torch.tensor(lead_digits)
        self.length = torch.tensor([len(data) for data in token_bytes[:vocab_size]] + [0] * (vocab_size - len(token_bytes)))

    def _flags(self, test) -> torch.Tensor:
        """Bool [vocab_size]: `test` of each token's bytes (False for ids the tokenizer does not have)."""
        flags = [test(data) for data in self.token_bytes[: self.vocab_size]]
        return torch.tensor(flags + [False] * (self.vocab_size - len(flags)))


@dataclass
class _Frame:
    kind: int  # ord("{") or ord("[")
    keys: set[bytes] = field(default_factory=set)
    expect_key: bool = False
    start: int = 0  # the first token inside it (an index of JsonState.history)
    looped: bool = False


class JsonState:
    """The lexical state of the JSON committed so far (text outside any JSON value, such as a tool
    call's markers, is read through without effect)."""

    def __init__(self, table: VocabTable):
        self.table = table
        self.stack: list[_Frame] = []
        self.in_string = self.is_key = self.escaped = False
        self.key = bytearray()
        self.digits = 0  # digits of the number being written (0 outside numbers)
        self.history: list[int] = []  # committed tokens, for the loop rule
        self.between_items = False
        self.string_start = 0  # the first token inside the open string
        self.string_looped = False
        self.loop_tokens: list[int] = []  # the period of the open string's loop

    def copy(self) -> JsonState:
        other = JsonState.__new__(JsonState)
        other.__dict__.update(self.__dict__)
        other.stack = [_Frame(f.kind, set(f.keys), f.expect_key, f.start, f.looped) for f in self.stack]
        other.key = bytearray(self.key)
        other.history = list(self.history)
        other.loop_tokens = list(self.loop_tokens)
        return other

    def feed(self, token: int) -> None:
        self.history.append(token)
        self.between_items = False  # whether a byte of this token stood between a list's items
        for byte in self.table.token_bytes[token]:
            self._byte(byte)
        if self.in_string and not self.is_key:
            period = _period(self.history[self.string_start:])
            if period:
                self.string_looped = True
                self.loop_tokens = sorted(set(self.loop_tokens) | set(self.history[-period:]))
        if self.between_items and self.stack and self.stack[-1].kind == 0x5B:  # `","` is one token: check it too
            frame = self.stack[-1]
            frame.looped = frame.looped or bool(_period(self.history[frame.start:]))

    def _byte(self, byte: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif byte == 0x5C:  # backslash
                self.escaped = True
            elif byte == 0x22:  # the closing quote
                self.in_string = False
                if self.is_key:
                    self.stack[-1].keys.add(bytes(self.key))
                return
            if self.is_key:
                self.key.append(byte)
            return
        top = self.stack[-1] if self.stack else None
        self.between_items = self.between_items or (top is not None and top.kind == 0x5B)
        if byte in _NUMBER:
            self.digits += byte in _DIGITS
            return
        self.digits = 0
        if byte == 0x22:
            self.in_string = True
            self.is_key = top is not None and top.kind == 0x7B and top.expect_key
            self.key = bytearray()
            self.string_start, self.string_looped, self.loop_tokens = len(self.history), False, []
        elif byte in (0x7B, 0x5B):
            self.stack.append(_Frame(byte, expect_key=byte == 0x7B, start=len(self.history)))
        elif byte in (0x7D, 0x5D) and self.stack:
            self.stack.pop()
        elif top is not None and top.kind == 0x7B and byte in (0x3A, 0x2C):  # ':' then a value, ',' then a key
            top.expect_key = byte == 0x2C

    def _in_looped_array(self) -> bool:
        return bool(self.stack) and self.stack[-1].kind == 0x5B and self.stack[-1].looped

    def loop_fallback(self) -> torch.Tensor | None:
        """Where `forbidden` leaves a looping string nothing (its pattern cannot close yet): the loop's
        own tokens, so that it must at least write something else."""
        if not (self.in_string and self.string_looped):
            return None
        out = torch.zeros(self.table.vocab_size, dtype=torch.bool)
        out[self.loop_tokens] = True
        return out

    def forbidden(self) -> torch.Tensor | None:
        """Bool [vocab] of the tokens that would break a rule of this module; None where none would."""
        table = self.table
        if self.in_string:
            if self.string_looped:
                return ~table.starts_quote | table.closes_then_comma if self._in_looped_array() else ~table.starts_quote
            if self._in_looped_array():
                return table.closes_then_comma
            if self.is_key and self.stack and self.stack[-1].keys:
                keys, key = self.stack[-1].keys, bytes(self.key)
                repeats = [token for token, head in table.key_ends if key + head in keys]
                if repeats:
                    out = torch.zeros(table.vocab_size, dtype=torch.bool)
                    out[repeats] = True
                    return out
            return None
        room = MAX_NUMBER_DIGITS - self.digits
        out = table.starts_number & (table.lead_digits > room) if room > 0 else table.starts_number.clone()
        if self.stack and self.stack[-1].looped:
            out |= table.starts_comma
        if self._at_key() and self.stack[-1].keys:
            out[[token for token, key in table.whole_keys if key in self.stack[-1].keys]] = True
        return out

    def _at_key(self) -> bool:
        """Outside strings, where an object's next key starts."""
        return bool(self.stack) and self.stack[-1].kind == 0x7B and self.stack[-1].expect_key

    def forbids(self, token: int) -> bool:
        """`forbidden()[token]` without the whole vector (the engine's check of one choice)."""
        table = self.table
        if self.in_string:
            if self.string_looped and not bool(table.starts_quote[token]):
                return True
            if self._in_looped_array() and bool(table.closes_then_comma[token]):
                return True
            if self.string_looped:
                return False
            if self.is_key and self.stack and self.stack[-1].keys:
                data = table.token_bytes[token]
                quote = data.find(b'"')
                return quote >= 0 and b"\\" not in data[:quote] and bytes(self.key) + data[:quote] in self.stack[-1].keys
            return False
        if bool(table.starts_number[token]) and int(table.lead_digits[token]) > MAX_NUMBER_DIGITS - self.digits:
            return True
        data = table.token_bytes[token]
        if self._at_key() and data[:1] == b'"' and b'"' in data[1:] and data[1: data.index(b'"', 1)] in self.stack[-1].keys:
            return True
        return bool(self.stack and self.stack[-1].looped and table.starts_comma[token])


def _period(tokens: list[int]) -> int:
    """The period (<= LOOP_PERIOD) of a run that ends `tokens`, repeated LOOP_REPEATS times over at least
    LOOP_SPAN tokens; 0 where there is none."""
    for period in range(1, LOOP_PERIOD + 1):
        span = max(period * LOOP_REPEATS, LOOP_SPAN)
        if len(tokens) >= span and all(tokens[-i] == tokens[-i - period] for i in range(1, span - period + 1)):
            return period
    return 0
