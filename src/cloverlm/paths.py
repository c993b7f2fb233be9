"""Folders of the source checkout this package runs from (an editable install): the shipped models and
the repository's data. One owner, so that moving a module never silently breaks a `parents[N]`."""

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # src/cloverlm/paths.py -> the repository root
DATA = CHECKOUT / "data"
MODELS = CHECKOUT / "models"
