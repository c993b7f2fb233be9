"""The `clover bench` report on disk: the JSON and, next to it, one PNG plot per section that has one and
ran (`<stem>_tasks.png`, `<stem>_context.png`, `<stem>_schema.png`, `<stem>_block_sizes.png`,
`<stem>_thresholds.png`)."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from cloverlm.bench.options import RUNNER_LABELS, RUNNERS
from cloverlm.bench.schema import SCHEMA_RUNNERS
from cloverlm.decoding.params import AUTO


def write_report(report: dict, json_path: Path) -> list[Path]:
    """The JSON at json_path and the plots of the sections it holds next to it; returns the paths written."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plots = {  # file suffix: (section, plot)
        "tasks": ("tasks", _plot_tasks), "context": ("context_scaling", _plot_context), "schema": ("schema", _plot_schema),
        "block_sizes": ("block_sizes", _plot_block_sizes), "thresholds": ("thresholds", _plot_thresholds),
    }
    paths = [json_path]
    for suffix, (section, plot) in plots.items():
        if section not in report:
            continue
        figure = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        plot(figure.add_subplot(), report)
        path = json_path.with_name(f"{json_path.stem}_{suffix}.png")
        figure.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _plot_tasks(axes, report: dict) -> None:
    names = list(report["tasks"])
    shown = [r for r in RUNNERS if all(report["tasks"][t].get(r) and report["tasks"][t][r]["wall_s_median"] for t in names)]
    width = 0.8 / len(shown)
    for offset, runner in enumerate(shown):
        walls = [report["tasks"][t][runner]["wall_s_median"] for t in names]
        axes.bar([x - 0.4 + width * (offset + 0.5) for x in range(len(names))], walls, width=width, label=RUNNER_LABELS[runner])
    if "peer" in shown:
        for x, name in enumerate(names):
            top = max(report["tasks"][name][r]["wall_s_median"] for r in shown)
            axes.annotate(f"{report['tasks'][name]['speedup']:.2f}x", (x, top), ha="center", va="bottom")
    axes.set_xticks(list(range(len(names))), names)
    axes.set_yscale("log")  # answers range from a few tokens to hundreds
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.yaxis.set_major_formatter(plain)
    axes.yaxis.set_minor_formatter(plain)
    axes.set_ylabel("median wall seconds per request")
    axes.set_title("Latency per request (batch 1); labels: speedup = peer / Clover")
    axes.legend(fontsize="small")


def _plot_context(axes, report: dict) -> None:
    rows = report["context_scaling"]
    contexts = [row["context"] for row in rows]
    axes.plot(contexts, [row["clover_block_ms"] for row in rows], "o-", label="Clover, per block forward")
    axes.plot(contexts, [row["memory_only_block_ms"] for row in rows], "s-", label="Clover memory-only, per block forward")
    if rows and rows[0]["hybrid_block_ms"] is not None:
        last = rows[-1]
        versus = "" if last["hybrid_vs_clover"] is None else f": {last['hybrid_vs_clover']:.2f}x Clover at {_context_label(last['context'])}"
        axes.plot(contexts, [row["hybrid_block_ms"] for row in rows], "D-", label=f"hybrid (grafted), per block forward{versus}")
    if rows and rows[0]["peer_token_ms"] is not None:
        axes.plot(
            contexts,
            [row["peer_token_ms"] * row["block_tokens"] for row in rows],
            "^-",
            label="peer, for the same tokens (per token x block_tokens)",
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(contexts, [_context_label(c) for c in contexts])
    axes.set_xlabel("context (tokens)")
    axes.set_ylabel("ms")
    axes.set_ylim(bottom=0)
    axes.set_title("Decoding cost against context")
    axes.legend()


def _context_label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def _plot_schema(axes, report: dict) -> None:
    section = report["schema"]
    runners = [name for name in SCHEMA_RUNNERS if section[name]]
    measures = {"schema-valid": "schema_valid", "zone exact": "zone_exact"}
    width = 0.8 / len(runners)
    for offset, name in enumerate(runners):
        xs = [x - 0.4 + width * (offset + 0.5) for x in range(len(measures))]
        row = section[name]
        label = f"{name.replace('_', ', ')}: TPF {row['tpf']:.2f}, {row['wall_s_median']:.1f} s a request"
        axes.bar(xs, [row[key] for key in measures.values()], width=width, label=label)
    axes.set_xticks(list(range(len(measures))), list(measures))
    axes.set_ylim(0, 1.3)  # headroom for the legend
    axes.set_ylabel("share of answers / of zones")
    speedup = f", speedup over the peer {section['speedup']:.2f}x" if section["speedup"] else ""
    if section.get("speedup_grounded"):
        speedup += f" (grounded {section['speedup_grounded']:.2f}x)"
    axes.set_title(f"no_fly_zones as JSON ({section['prompts']} prompts, {section['messages']} messages){speedup}", fontsize="medium")
    axes.legend(fontsize="small", loc="upper left")


def _plot_block_sizes(axes, report: dict) -> None:
    rows = [row for row in report["block_sizes"] if row["block_size"] != AUTO]
    auto = [row for row in report["block_sizes"] if row["block_size"] == AUTO]
    axes.set_xscale("log", base=2)
    lines = _plot_sweep(axes, rows, "block_size", auto)
    if auto:  # "auto" has no place on the size axis: a level line per measure
        lines.append(axes.axhline(auto[0]["tpf"], color="tab:blue", linestyle=":", label="auto: tokens per forward"))
        lines.append(axes.accuracy_axes.axhline(auto[0]["accuracy"], color="tab:orange", linestyle=":", label="auto: accuracy"))
    axes.set_xlabel("block size")
    axes.legend(handles=lines, loc="best")
    axes.set_title(f"Block-size sweep ({report['meta']['sweep_task']}, threshold {report['meta']['threshold']})")


def _plot_thresholds(axes, report: dict) -> None:
    lines = _plot_sweep(axes, report["thresholds"], "threshold")
    axes.set_xlabel("confidence threshold")
    axes.legend(handles=lines, loc="best")
    axes.set_title(f"Threshold sweep ({report['meta']['sweep_task']}, block size {report['meta']['block_size']})")


def _plot_sweep(axes, rows: list[dict], key: str, extra_rows: list[dict] = ()) -> list:
    """TPF (left axis) and accuracy (right axis, kept on axes.accuracy_axes) against rows[i][key]."""
    xs = [row[key] for row in rows]
    tpf_line = axes.plot(xs, [row["tpf"] for row in rows], "o-", color="tab:blue", label="tokens per forward")
    axes.set_xticks(xs, [str(x) for x in xs])
    axes.set_ylabel("tokens per forward", color="tab:blue")
    axes.set_ylim(0, 1.2 * max(row["tpf"] for row in [*rows, *extra_rows]))  # headroom for the legend
    axes.accuracy_axes = axes.twinx()
    accuracy_line = axes.accuracy_axes.plot(xs, [row["accuracy"] for row in rows], "s--", color="tab:orange", label="accuracy")
    axes.accuracy_axes.set_ylabel("accuracy", color="tab:orange")
    axes.accuracy_axes.set_ylim(0, 1.05)
    return tpf_line + accuracy_line
