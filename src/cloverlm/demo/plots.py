"""The demo's two pictures: the no-fly zones as cylinders on a 3D map, and one block's denoising steps.

Zones come straight from model output, so every field is checked before it is drawn: a zone whose
centre, radius, unit or altitudes do not read as a place in the sky is counted, named in the legend
and left out, never guessed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

MAP_SIZE_INCHES = (9.0, 7.0)
DPI = 100  # the map is 900 x 700 pixels
NM_PER_DEGREE_LATITUDE = 60.0
KM_PER_NM = 1.852
MAX_DRAWN_LATITUDE = 85.0  # nearer the poles a circle's longitude extent (radius / cos(lat)) explodes
# How each source is drawn: models as translucent solids, the truth as a dashed outline, so that a
# zone a model got right shows as a solid inside the outline.
SOURCE_COLORS = {"truth": "tab:green", "Clover": "tab:blue", "peer": "tab:orange"}
MASKED_COLOR, UNMASKED_COLOR, NEW_COLOR = "#c8c8c8", "#ffffff", "#ffd54f"
CELL_TEXT_CHARS = 7


@dataclass(frozen=True)
class Cylinder:
    """A zone in map units: centre in degrees, radius in degrees of latitude, altitudes in feet."""

    label: str
    lat: float
    lon: float
    radius_deg: float
    lower_ft: float
    upper_ft: float

    @property
    def lon_radius_deg(self) -> float:
        # a degree of longitude shrinks with cos(latitude): the same distance spans more of them
        return self.radius_deg / math.cos(math.radians(self.lat))


def _number(value) -> float | None:
    """A finite number from a JSON number or a numeric string; None otherwise (booleans included)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


_FEET = re.compile(r"(\d+(?:\.\d+)?)\s*FT")
_FLIGHT_LEVEL = re.compile(r"FL\s*(\d+)")


def altitude_ft(value) -> float | None:
    """Feet above ground from a NOTAM altitude: "SFC" or "GND" is 0, "400FT" is 400, "FL050" is 5000,
    a bare number is taken as feet; None for anything else."""
    if not isinstance(value, str):
        return _number(value)
    text = value.strip().upper()
    if text in ("SFC", "GND"):
        return 0.0
    if match := _FEET.fullmatch(text):
        return float(match[1])
    if match := _FLIGHT_LEVEL.fullmatch(text):
        return float(match[1]) * 100
    return _number(text)


def zone_cylinder(zone: Mapping) -> Cylinder | None:
    """The cylinder of a parsed zone, or None when a field needed to draw it is missing or impossible."""
    lat, lon, radius = _number(zone.get("lat")), _number(zone.get("lon")), _number(zone.get("radius"))
    lower, upper = altitude_ft(zone.get("lower")), altitude_ft(zone.get("upper"))
    unit = str(zone.get("unit", "")).strip().upper()
    if None in (lat, lon, radius, lower, upper) or unit not in ("NM", "KM"):
        return None
    if abs(lat) > MAX_DRAWN_LATITUDE or abs(lon) > 180 or radius <= 0 or not 0 <= lower < upper:
        return None
    radius_nm = radius if unit == "NM" else radius / KM_PER_NM
    return Cylinder(str(zone.get("id", "?")), lat, lon, radius_nm / NM_PER_DEGREE_LATITUDE, lower, upper)


def _draw_cylinder(axes, cylinder: Cylinder, color: str, solid: bool) -> None:
    angles = np.linspace(0, 2 * np.pi, 49)
    x = cylinder.lon + cylinder.lon_radius_deg * np.cos(angles)
    y = cylinder.lat + cylinder.radius_deg * np.sin(angles)
    for altitude in (cylinder.lower_ft, cylinder.upper_ft):
        axes.plot(x, y, np.full_like(x, altitude), color=color, linewidth=1.0, linestyle="-" if solid else "--")
    if solid:
        heights = np.array([[cylinder.lower_ft], [cylinder.upper_ft]])
        axes.plot_surface(np.vstack([x, x]), np.vstack([y, y]), np.repeat(heights, len(x), axis=1),
                          color=color, alpha=0.3, linewidth=0, shade=False)
    else:
        for index in range(0, len(angles) - 1, 12):  # four upright edges make the outline read as a cylinder
            axes.plot([x[index]] * 2, [y[index]] * 2, [cylinder.lower_ft, cylinder.upper_ft],
                      color=color, linewidth=1.0, linestyle="--")


def _ground_limits(axes, cylinders: Sequence[Cylinder]) -> None:
    """Axis limits around all cylinders that give a degree of latitude and cos(lat) degrees of
    longitude the same length on screen, so that zones are drawn round and to scale."""
    south = min(c.lat - c.radius_deg for c in cylinders)
    north = max(c.lat + c.radius_deg for c in cylinders)
    west = min(c.lon - c.lon_radius_deg for c in cylinders)
    east = max(c.lon + c.lon_radius_deg for c in cylinders)
    middle_lat, middle_lon = (south + north) / 2, (west + east) / 2
    shrink = math.cos(math.radians(middle_lat))
    half = 0.55 * max(north - south, (east - west) * shrink)  # in degrees of latitude, with a margin
    axes.set_ylim(middle_lat - half, middle_lat + half)
    axes.set_xlim(middle_lon - half / shrink, middle_lon + half / shrink)


def render_zone_map(sources: Mapping[str, Sequence[Mapping]], path: Path, title: str) -> dict[str, int]:
    """Draw each source's zones (sources: "truth", "Clover", "peer" -> parsed zones) on a 3D
    longitude / latitude / altitude map, save it as a PNG at `path`; returns how many zones of each
    source were drawn."""
    figure = Figure(figsize=MAP_SIZE_INCHES, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(projection="3d")
    cylinders = {source: [c for c in map(zone_cylinder, zones) if c is not None] for source, zones in sources.items()}
    drawn = [c for source_cylinders in cylinders.values() for c in source_cylinders]
    top = max((c.upper_ft for c in drawn), default=0.0)
    legend = []
    for rank, (source, zones) in enumerate(sources.items()):
        color = SOURCE_COLORS[source]
        for cylinder in cylinders[source]:
            _draw_cylinder(axes, cylinder, color, solid=source != "truth")
            # each source's label a little higher, so that labels of the same zone do not overprint
            axes.text(cylinder.lon, cylinder.lat, cylinder.upper_ft + 0.06 * top * rank, cylinder.label,
                      color=color, fontsize=8, parse_math=False)
        count = len(cylinders[source])
        if not zones:
            label = f"{source}: no zones parsed"
        else:
            label = f"{source}: {count} zone{'s' * (count != 1)}"
            if count < len(zones):
                label += f" ({len(zones) - count} more parsed, not drawable)"
        handle = (Patch(facecolor=color, alpha=0.4, edgecolor=color) if source != "truth"
                  else Line2D([], [], color=color, linestyle="--"))
        legend.append((handle, label))
    if drawn:
        _ground_limits(axes, drawn)
    else:
        axes.text2D(0.5, 0.5, "no zones parsed", transform=axes.transAxes, ha="center", fontsize=14)
    axes.set_xlabel("longitude (°E)")
    axes.set_ylabel("latitude (°N)")
    axes.set_zlabel("altitude (ft)")
    axes.set_title(title, parse_math=False)
    if legend:
        axes.legend(*zip(*legend), loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return {source: len(source_cylinders) for source, source_cylinders in cylinders.items()}


def _cell_text(text: str) -> str:
    """A token's text made visible in a cell: blanks and line ends marked, long pieces cut."""
    text = text.replace(" ", "␣").replace("\n", "⏎")
    return text if len(text) <= CELL_TEXT_CHARS else text[: CELL_TEXT_CHARS - 1] + "…"


def render_denoising_strip(steps: Sequence[Sequence[str | None]], path: Path, title: str) -> None:
    """One block's denoising as a grid saved to `path`: a row per step, a column per block position,
    each cell the position's token text after that step (None: still masked, grey); the cells
    unmasked at that step are highlighted."""
    rows, columns = len(steps), len(steps[0])
    figure = Figure(figsize=(max(6.0, 0.8 * columns + 1.4), 0.4 * rows + 1.4), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    before = [None] * columns  # the block starts fully masked
    for row, cells in enumerate(steps):
        for column, text in enumerate(cells):
            if text is None:
                color = MASKED_COLOR
            else:
                color = NEW_COLOR if before[column] is None else UNMASKED_COLOR
                axes.text(column + 0.5, row + 0.5, _cell_text(text), ha="center", va="center",
                          fontsize=7, family="monospace", parse_math=False)
            axes.add_patch(Rectangle((column, row), 1, 1, facecolor=color, edgecolor="#888888", linewidth=0.5))
        before = cells
    axes.set_xlim(0, columns)
    axes.set_ylim(rows, 0)  # step 1 on top
    axes.set_xticks([c + 0.5 for c in range(columns)], [str(c) for c in range(columns)], fontsize=7)
    axes.set_yticks([r + 0.5 for r in range(rows)], [f"step {r + 1}" for r in range(rows)], fontsize=7)
    axes.set_xlabel("position in the block")
    axes.tick_params(length=0)
    axes.set_title(title, fontsize=9, parse_math=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
