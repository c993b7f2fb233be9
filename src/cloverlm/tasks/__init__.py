"""Seeded, deterministic task generators with field-by-field checkers.

Each task turns a seed into an Example (prompt, exact answer, structured truth) and scores a model output
against it without ever raising: unparseable output simply scores zero.
"""

from cloverlm.tasks.arithmetic import Arithmetic
from cloverlm.tasks.base import Example, Task
from cloverlm.tasks.kv_retrieval import KVRetrieval
from cloverlm.tasks.no_fly_zones import NoFlyZones, parse_zones
from cloverlm.tasks.repeat import Repeat
from cloverlm.tasks.tool_call import ToolCall

__all__ = ["SUITE", "TASKS", "Example", "Task", "generate", "get_task", "parse_zones"]

TASKS: dict[str, Task] = {t.name: t for t in (NoFlyZones(), ToolCall(), KVRetrieval(), Arithmetic(), Repeat())}
# The evaluation suite: the tasks a user asks for (repeat only trains the copying skill).
SUITE = ("no_fly_zones", "tool_call", "kv_retrieval", "arithmetic")


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from: {', '.join(TASKS)}")
    return TASKS[name]


def generate(name: str, seed: int, **size) -> Example:
    return get_task(name).generate(seed, **size)
