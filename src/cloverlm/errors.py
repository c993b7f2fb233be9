"""The one exception type that reaches users: its message is a complete, one-line explanation."""


class CloverError(ValueError):
    """Bad input (prompt, checkpoint, config, block size): the CLI prints the message, not a traceback."""
