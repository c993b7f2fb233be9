"""Drone slots: assign up to 8 drones to landing zones so that no two share one, each within the zones
it may use. The allowed sets are pruned until exactly one assignment works, so the answers depend on
each other: a drone's zone is only certain once the others' are known (joint decisions, `cloverlm.decoding.decisions`).

Not in `tasks.TASKS`: adding a source there would change the default tokenizer's training text.
The answer is the decision layout: {"1":"<zone of drone 1>","2":...}.
"""

import json
import random

from cloverlm.tasks.base import Example, mean

MAX_DRONES = 8


def _assignments(allowed: list[list[int]], limit: int = 2) -> int:
    """How many one-zone-per-drone assignments exist (counting stops at `limit`)."""
    count = 0

    def place(drone: int, used: set[int]) -> None:
        nonlocal count
        if count >= limit:
            return
        if drone == len(allowed):
            count += 1
            return
        for zone in allowed[drone]:
            if zone not in used:
                place(drone + 1, used | {zone})

    place(0, set())
    return count


def consistent(answers: dict, allowed: list[list[int]]) -> bool:
    """Every drone has a zone it may use and no two drones share one."""
    zones = [answers.get(str(drone + 1)) for drone in range(len(allowed))]
    try:
        zones = [int(zone) for zone in zones]
    except (TypeError, ValueError):
        return False
    return len(set(zones)) == len(zones) and all(zone in allowed[d] for d, zone in enumerate(zones))


class DroneSlots:
    name = "drone_slots"

    def generate(self, seed: int, drones: int = MAX_DRONES) -> Example:
        if not 2 <= drones <= MAX_DRONES:
            raise ValueError(f"drones must be in 2..{MAX_DRONES}, got {drones}")
        rng = random.Random(seed)
        zones = list(range(1, drones + 1))
        solution = rng.sample(zones, drones)  # drone d takes zone solution[d]
        allowed = [sorted({solution[d], *rng.sample(zones, 2)}) for d in range(drones)]
        while _assignments(allowed) > 1:  # prune a wrong option until the assignment is unique
            drone = rng.choice([d for d in range(drones) if len(allowed[d]) > 1])
            allowed[drone].remove(rng.choice([z for z in allowed[drone] if z != solution[drone]]))
        lines = [f"Drone {d + 1} may land in zone {' or '.join(map(str, allowed[d]))}." for d in range(drones)]
        prompt = (
            f"Assign each of {drones} drones to a landing zone (1-{drones}); no two drones may share a zone.\n"
            + "\n".join(lines)
        )
        truth = {str(d + 1): str(solution[d]) for d in range(drones)}
        return Example(
            task=self.name, seed=seed, prompt=prompt, answer=json.dumps(truth, separators=(",", ":")),
            truth={"zones": truth, "allowed": allowed}, value_spans=(),
        )

    def questions(self, example: Example) -> list[tuple[str, list[str]]]:
        """One question per drone, for `cloverlm.decoding.decisions`: (question, options)."""
        count = len(example.truth["allowed"])
        return [(f"Which zone does drone {d + 1} land in?", [str(z) for z in range(1, count + 1)]) for d in range(count)]

    def answer_schema(self, example: Example) -> None:
        """None: its answers are decided as slots (`questions`, `cloverlm.decoding.decisions`)."""
        return None

    def check(self, example: Example, output: str) -> dict[str, float]:
        try:
            answers = json.loads(output)
        except ValueError:
            answers = None
        if not isinstance(answers, dict):
            return {"parsed": 0.0, "consistent": 0.0, "drones": 0.0, "exact": 0.0}
        truth = example.truth["zones"]
        return {
            "parsed": 1.0,
            "consistent": float(consistent(answers, example.truth["allowed"])),
            "drones": mean(answers.get(k) == v for k, v in truth.items()),
            "exact": float(all(answers.get(k) == v for k, v in truth.items())),
        }
