"""Drafts for a block from the request's own context (prompt lookup, docs/design.md section 4a).

On extraction most answer tokens are copied from the prompt. Before a denoising step the engine may
fill a block's masked slots with a draft: what followed, earlier in the context, the longest n-gram
(n <= DRAFT_NGRAM) that ends the known text. The model then accepts or rejects each drafted slot by the
threshold rule; a draft never decides a token by itself.
"""

from __future__ import annotations

DRAFT_NGRAM = 3  # the longest suffix matched; shorter ones are tried when it does not occur


class PromptLookup:
    """An n-gram index over a growing token sequence: for each n-gram, where it last ended."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, DRAFT_NGRAM + 1):
                if end - n - 1 >= 0:  # index the n-gram ending before this token: it has a continuation
                    self.last_end[tuple(self.tokens[end - n - 1 : end - 1])] = end - 1

    def propose(self, known_suffix: list[int], length: int) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the longest n-gram ending
        `self.tokens + known_suffix` (the block's known prefix goes in known_suffix); [] without a match."""
        text = self.tokens[-DRAFT_NGRAM:] + known_suffix
        for n in range(min(DRAFT_NGRAM, len(text)), 0, -1):
            end = self.last_end.get(tuple(text[-n:]))
            if end is not None:
                return self.tokens[end : end + length]
        return []
