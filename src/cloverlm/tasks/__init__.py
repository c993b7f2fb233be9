"""Seeded, deterministic task generators with field-by-field checkers.

Each task turns a seed into an Example (prompt, exact answer, structured truth) and scores a model output
against it without ever raising: unparseable output simply scores zero.

TASKS are the tasks a model may train on (mixture sources, the default tokenizer's sample text);
HELD_OUT tasks are only ever evaluated: no_fly_zones_unseen asks the no_fly_zones question in phrasings
the training task never writes. TRAIN_ONLY tasks are mixture sources outside TASKS (which would change
the default tokenizer's text) and outside the suite: no_fly_zones_varied asks it in phrasings composed
from parts (no_fly_varied.py). `get_task` and `generate` know all three.
"""

from cloverlm.tasks.arithmetic import Arithmetic
from cloverlm.tasks.base import Example, Task
from cloverlm.tasks.kv_retrieval import KVRetrieval
from cloverlm.tasks.no_fly_phrasings import UNSEEN
from cloverlm.tasks.no_fly_varied import VARIED
from cloverlm.tasks.no_fly_zones import NoFlyZones, parse_zones
from cloverlm.tasks.repeat import Repeat
from cloverlm.tasks.tool_call import ToolCall

__all__ = ["HELD_OUT", "SUITE", "TASKS", "TRAIN_ONLY", "Example", "Task", "generate", "get_task", "parse_zones"]

TASKS: dict[str, Task] = {t.name: t for t in (NoFlyZones(), ToolCall(), KVRetrieval(), Arithmetic(), Repeat())}
HELD_OUT: dict[str, Task] = {t.name: t for t in (NoFlyZones("no_fly_zones_unseen", UNSEEN),)}
TRAIN_ONLY: dict[str, Task] = {t.name: t for t in (NoFlyZones("no_fly_zones_varied", VARIED),)}
# The evaluation suite: the tasks a user asks for (repeat only trains the copying skill); `clover eval`
# adds the HELD_OUT phrasings.
SUITE = ("no_fly_zones", "tool_call", "kv_retrieval", "arithmetic")


def get_task(name: str) -> Task:
    task = TASKS.get(name) or HELD_OUT.get(name) or TRAIN_ONLY.get(name)
    if task is None:
        raise ValueError(f"unknown task {name!r}; choose from: {', '.join([*TASKS, *HELD_OUT, *TRAIN_ONLY])}")
    return task


def generate(name: str, seed: int, **size) -> Example:
    return get_task(name).generate(seed, **size)
