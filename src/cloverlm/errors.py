"""The one exception type that reaches users (its message is a complete, one-line explanation), and the
token-id check every entry point that takes ids makes (the model, the engine, the peer, the server)."""

from collections.abc import Sequence


class CloverError(ValueError):
    """Bad input (prompt, checkpoint, config, block size): the CLI prints the message, not a traceback."""


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "token ids") -> None:
    """Raise unless every id indexes the vocabulary (ids: a non-empty sequence or tensor)."""
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise CloverError(f"{what} must be in 0..{vocab_size - 1}")
