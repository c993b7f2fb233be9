"""The demo's input: air-traffic messages (the no_fly_zones task's held-out ones with their truth, or
a user's file, one a line) and the prompt built from as many of them as fit, with its answer budget.

A file that cannot be read or holds no messages is a CloverError; bytes that are not UTF-8 are
replaced and special tokens removed, both named in notes for the user.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from pathlib import Path

from cloverlm import tasks
from cloverlm.errors import CloverError
from cloverlm.evaluation.heldout import ANSWER_SLACK, HELDOUT_SEED_BASE
from cloverlm.tasks.base import Example
from cloverlm.tasks.no_fly_zones import format_prompt, prompt_messages
from cloverlm.tokenizer import SPECIAL_TOKENS, format_chat

TASK = "no_fly_zones"
GENERATED_MESSAGES = 20
# The prompt (chat template included) may hold at most this many tokens: about 50 messages. The
# models were trained on 1,024-token rows; beyond a few thousand tokens they are on unseen ground.
PROMPT_TOKEN_LIMIT = 4096
# Answer budget: a zone's JSON object is at most 72 tokens (numbers in groups of three digits); the generator
# hides at most 5 zones among its messages, so no trained answer is longer than 5 of them. The slack
# covers the list's brackets and the end of the turn.
TOKENS_PER_ZONE = 80
MAX_ZONES = 5
LISTED_LINES = 10  # line numbers named in a note before "and N more"


@dataclass
class Messages:
    """The demo's input: message texts, the task example they came from (its truth scores the
    answers; None for a user's file) and notes for the user about the input."""

    texts: list[str]
    example: Example | None = None
    notes: list[str] = field(default_factory=list)


def generated_messages(seed: int) -> Messages:
    """The 20 messages of the task's held-out prompt `seed` (a seed never trained on)."""
    example = tasks.generate(TASK, HELDOUT_SEED_BASE + seed, n_messages=GENERATED_MESSAGES)
    return Messages(prompt_messages(example.prompt), example)


def read_messages(path: Path) -> Messages:
    """The non-blank lines of a file as messages. Lines that are not UTF-8 are decoded with U+FFFD
    replacing the bad bytes; the tokenizer's special tokens are removed (text such as "[MASK]" or
    "<|im_end|>" would otherwise reach the model as control tokens); both are named in notes."""
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise CloverError(f"cannot read the messages file {path}: {error.strerror or error}") from None
    texts, undecodable, special = [], [], []
    for number, line in enumerate(raw.removeprefix(codecs.BOM_UTF8).splitlines(), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            text = line.decode("utf-8", errors="replace")
            undecodable.append(number)
        if any(token in text for token in SPECIAL_TOKENS):
            special.append(number)
            for token in SPECIAL_TOKENS:
                text = text.replace(token, "")
        if text.strip():
            texts.append(text.strip())
    if not texts:
        raise CloverError(f"{path} holds no messages: expected one message a line")
    notes = []
    if undecodable:
        notes.append(f"{path}: {_lines(undecodable)} not valid UTF-8; the undecodable bytes are shown as �")
    if special:
        notes.append(f"{path}: {_lines(special)} held the model's special tokens ({', '.join(SPECIAL_TOKENS)}); "
                     "they were removed")
    return Messages(texts, None, notes)


def _lines(numbers: list[int]) -> str:
    """Line numbers for a note: 'line 2, 5', or for many 'line 1, 2, ..., 10 and 40 more'."""
    listed = ", ".join(map(str, numbers[:LISTED_LINES]))
    return f"line {listed}" + (f" and {len(numbers) - LISTED_LINES} more" if len(numbers) > LISTED_LINES else "")


def answer_token_budget(message_count: int) -> int:
    """Max new tokens: room for one zone per message, up to the most zones a trained prompt hides."""
    return TOKENS_PER_ZONE * min(message_count, MAX_ZONES) + ANSWER_SLACK


def fit_prompt(tokenizer, messages: list[str], limit: int = PROMPT_TOKEN_LIMIT) -> tuple[list[int], int]:
    """The prompt's token ids for the longest leading run of `messages` whose prompt has at most
    `limit` tokens, and how many messages that is."""

    def encode(count: int) -> list[int]:
        text = format_chat(tokenizer, format_prompt(messages[:count]))[0]
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = encode(len(messages))
    if len(ids) <= limit:
        return ids, len(messages)
    fits, too_long = 0, len(messages)  # the prompt grows with the count: bisect for the last that fits
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        if len(encode(middle)) <= limit:
            fits = middle
        else:
            too_long = middle
    if fits == 0:
        raise CloverError(f"message 1 alone makes a prompt of {len(encode(1))} tokens; the limit is {limit}")
    return encode(fits), fits
