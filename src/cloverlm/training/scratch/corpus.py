"""The training corpus: the running interpreter's own standard library.

Files outside test folders form the "train" split, files inside them (``test``, ``tests``,
``idle_test``) the "val" split. Installed third-party packages are never included.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

SPLITS = ("train", "val")
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


def stdlib_root() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str) -> list[Path]:
    """Sorted ``.py`` files of the standard library for ``split`` ("train" or "val")."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    root = stdlib_root()
    want_test = split == "val"
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts[:-1]
        if any(p in EXCLUDED_DIRS for p in parts) or not path.is_file():
            continue
        if any(p in TEST_DIRS for p in parts) == want_test:
            files.append(path)
    return sorted(files)


def read_source(path: str | Path) -> str | None:
    """The file's UTF-8 text, or None if it does not decode (some test files are deliberately bad)."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
