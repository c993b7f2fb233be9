"""What `clover demo` shows: the live view of Clover's denoising steps, the zone and score tables, the
wall times and the JSON report. The pipeline that produces them is demo/run.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cloverlm.tasks.no_fly_zones import FIELDS

MASK_SHOWN = "░"  # a still-masked position in the live view


@dataclass
class ModelRun:
    """One model's answer to the prompt."""

    name: str
    text: str
    tokens: int
    wall_s: float
    zones: list[dict]
    scores: dict[str, float] | None  # the task checker's fields; None without a truth
    tpf: float  # generated tokens per decoding forward


# ----------------------------------------------------------------------------------------------
# Clover, with its live view and the record of its denoising steps


class DecodeView:
    """Takes the engine's streaming callbacks for one request. Keeps every denoising step of every
    block (generated positions only) and the committed tokens, and renders (for rich.Live) the
    committed text followed by the current block's provisional tokens.

    Live renders from its own thread: the attributes it reads are replaced whole, never edited."""

    def __init__(self, tokenizer, mask_id: int):
        self.tokenizer = tokenizer
        self.mask_id = mask_id
        self.blocks: list[list[list[int]]] = []  # per block, the block after each step
        self.committed: list[int] = []
        self.committed_text = ""
        self.provisional: list[int] = []
        self._block_finished = True

    def on_step(self, request, block: list[int]) -> None:
        if self._block_finished:
            self.blocks.append([])
        self.blocks[-1].append(block)
        self._block_finished = self.mask_id not in block
        self.provisional = block

    def on_block(self, request, tokens: list[int]) -> None:
        self.committed = self.committed + tokens
        self.committed_text = self.tokenizer.decode(self.committed)
        self.provisional = []

    def __rich__(self) -> Panel:
        text = Text(self.committed_text)
        for token in self.provisional:
            if token == self.mask_id:
                text.append(MASK_SHOWN, style="dim")
            else:
                text.append(self.tokenizer.decode([token]), style="bold yellow")
        title = f"Clover: block {len(self.blocks)}, {len(self.committed)} tokens committed"
        return Panel(text, title=title, subtitle="yellow: provisional, ░: still masked", title_align="left")

    def strip_block(self) -> tuple[int, list[list[int]]]:
        """The block the denoising strip shows: the first that took more than one step, else the
        first; returns its number (from 1) and its steps."""
        number = next((i for i, steps in enumerate(self.blocks) if len(steps) > 1), 0)
        return number + 1, self.blocks[number]
# ----------------------------------------------------------------------------------------------
# What the user sees


def note(console: Console, message: str) -> None:
    console.print(Text.assemble(("note: ", "bold yellow"), message))


def zones_table(title: str, zones: list[dict]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in FIELDS:
        # on a narrow terminal the long times wrap and the short fields stay whole
        table.add_column(name, overflow="fold", no_wrap=name not in ("start", "end"))
    for zone in zones:
        # Text cells: model output may hold square brackets, which rich would read as markup
        table.add_row(*(Text(_cell(zone[name]) if name in zone else "—") for name in FIELDS))
    return table


def _cell(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def show_zones(console: Console, run: ModelRun) -> None:
    if run.zones:
        console.print(zones_table(f"{run.name}: {len(run.zones)} zones", run.zones))
    else:
        console.print(f"{run.name}: no zones found (its answer is not a JSON list of zone objects)")


def scores_table(runs: list[ModelRun]) -> Table:
    table = Table(title="score against the truth", title_justify="left")
    table.add_column("field")
    for run in runs:
        table.add_column(run.name, justify="right")
    for key in runs[0].scores:
        table.add_row(key, *(f"{run.scores[key]:.2f}" for run in runs))
    return table


SCORES_EXPLAINED = (
    "field/NAME: share of the true zones whose NAME the model got right (zones matched by id); "
    "zone_exact_match: zones exactly right / max(true zones, parsed zones); "
    "count: the right number of zones; exact: the whole answer right"
)


def timing(clover: ModelRun, peer: ModelRun | None) -> str:
    line = f"wall time (each model warmed up first, untimed): Clover {clover.wall_s:.2f} s for {clover.tokens} tokens ({clover.tpf:.2f} tokens per forward)"
    if peer is not None:
        line += (f"; peer {peer.wall_s:.2f} s for {peer.tokens} tokens ({peer.tpf:.2f} tokens per forward); "
                 f"speedup (peer time / Clover time) {peer.wall_s / clover.wall_s:.2f}x")
    return line


def report_json(clover: ModelRun, peer: ModelRun | None) -> dict:
    """The --json report; zone_exact_match is null without a truth, the peer and speedup without a peer."""

    def exact(run: ModelRun):
        return None if run.scores is None else run.scores["zone_exact_match"]

    report = {
        "clover": {"zones": clover.zones, "wall_s": round(clover.wall_s, 3), "tpf": round(clover.tpf, 3),
                   "zone_exact_match": exact(clover)},
        "peer": None,
        "speedup": None,
    }
    if peer is not None:
        report["peer"] = {"zones": peer.zones, "wall_s": round(peer.wall_s, 3), "tpf": round(peer.tpf, 3),
                          "zone_exact_match": exact(peer)}
        report["speedup"] = round(peer.wall_s / clover.wall_s, 3)
    return report
