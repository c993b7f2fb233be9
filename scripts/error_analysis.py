"""Error analysis of a Clover model on no_fly_zones: which fields, phrasings and distractor kinds fail.

Decodes the held-out prompts as `clover eval` does (its examples, answer budget and schema, threshold
0.9, evaluate.py's engine loop, batch 8), scores each answer with the task's checker, regenerates each
prompt from its seed (`NoFlyZones.compose`) to know which template wrote which message, and attributes
every listed zone to the message it was copied from. A truncated answer still gives its complete zone
objects, so the zone tables also see the errors the checker scores as a flat zero.

  .venv/bin/python scripts/error_analysis.py --n 20 --block-sizes 1 16 --unseen 10 --json runs/ea.json
  .venv/bin/python scripts/error_analysis.py --rescore runs/ea.json --json runs/ea2.json   # no decoding
"""

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from difflib import SequenceMatcher

import torch

from cloverlm import tasks
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.decoding.grammar import Grammars
from cloverlm.evaluation.evaluate import _clover_completions, answer_grammar  # the loop `clover eval` runs
from cloverlm.evaluation.heldout import answer_budget, heldout_examples
from cloverlm.model.checkpoint import inference_dtype
from cloverlm.tasks.base import same
from cloverlm.tasks.no_fly_phrasings import SEEN, template_fields
from cloverlm.tasks.no_fly_zones import FIELDS
from cloverlm.tokenizer import parse_json, stop_token_ids

# Distractor kinds by wording, not by index, so that added or reordered templates and both families
# are read alike. First match wins; "plain-geo" ones carry a circle but are not about drones.
KINDS = {"cancelled": r"NOTAMC", "lifted": r"lifted|rescinded|may again", "expired": r"expired",
         "proposed": r"proposed|PLANNED|planned|consultation", "helicopter-only": r"HEL FLT|helicopter",
         "drones-fly-here": r"model aircraft|delivery corridor|TEST AREA"}
TRUTH = ("found", "missed", "cut off")  # what becomes of each true zone
LISTED = ("found", "spurious", "duplicate", "hallucinated")  # what each listed zone is
TRAINED_ZONES = 5  # SEEN.zones[:5]: the only zone wording the shipped adapter saw (models/README.md)


def label_of(family, template: str, is_zone: bool) -> tuple[str, str | None]:
    """A distractor's kind, or a zone template's name and group: wording the shipped adapter trained on
    or not, NOTAM or prose."""
    if not is_zone:
        other = "plain-geo" if "{lat}" in template else "plain"
        return next((kind for kind, pattern in KINDS.items() if re.search(pattern, template)), other), None
    index, style = family.zones.index(template), "notam" if "NOTAMN" in template else "prose"
    if family is not SEEN:
        return f"unseen z{index:02d}", f"unseen {style}"
    return f"seen z{index:02d}", f"seen {'trained' if index < TRAINED_ZONES else 'new'} {style}"


def answer_value(key: str, raw: str):
    return float(raw) if key in ("lat", "lon", "radius") else raw


def salvage(text: str) -> list[dict]:
    """The complete zone objects of an answer, also of one cut off by the budget (zones are flat)."""
    return [z for z in (parse_json(c, "{") for c in re.findall(r"\{[^{}]*\}", text)) if isinstance(z, dict)]


def field_error(key, value, source, messages) -> tuple[str, str | None]:
    """Where a wrong value came from (that decides what data fixes it) and, for a value copied from
    another message, which: its offset from the zone's message and whether it is a zone itself."""
    own = source["fields"]
    if any(same(value, answer_value(k, own[k])) for k in own if k != key):
        return "own message, other field", None
    donors = [m for m in messages if m is not source and key in m["fields"]
              and same(value, answer_value(key, m["fields"][key]))]
    if donors:
        d = min(donors, key=lambda m: abs(m["position"] - source["position"]))
        offset = d["position"] - source["position"]
        return "other message", f"{offset:+d} {'zone' if d['zone'] else 'distractor'}"
    if SequenceMatcher(None, str(answer_value(key, own[key])), str(value)).ratio() >= 0.8:
        return "digit slip (near the truth)", None
    return "not in prompt", None


def analyse(task, encoded, text: str, n_tokens: int) -> dict:
    messages = []
    for position, (template, fields, is_zone) in enumerate(task.compose(encoded.example.seed, 20)):
        label, group = label_of(task.family, template, is_zone)
        shown = {k: fields[k] for k in FIELDS if k in template_fields(template)}  # what the message holds
        messages.append(dict(position=position, zone=is_zone, label=label, group=group, fields=shown))
    truth = [answer_value(k, m["fields"][k]) for m in messages if m["zone"] for k in FIELDS]
    assert truth == [v for z in encoded.example.truth for v in z.values()], "compose() no longer matches"
    # Under the schema only the budget leaves an answer unparsed.
    status = "truncated" if n_tokens >= answer_budget(encoded) else "malformed"
    status = "parsed" if parse_json(text, "[") is not None else status

    def agreement(pred, m):
        hits = sum(same(pred.get(k), answer_value(k, v)) for k, v in m["fields"].items())
        return hits, same(pred.get("id"), m["fields"]["id"]), m["zone"]

    preds = [(pred, max(messages, key=lambda m: agreement(pred, m))) for pred in salvage(text)]
    best = {}  # a zone listed twice (often first under the id of the message above) counts by its best copy
    for pred, src in sorted(preds, key=lambda ps: agreement(*ps), reverse=True):
        best.setdefault(src["position"], pred)
    events = []
    for pred, src in preds:
        if agreement(pred, src)[0] == 0:
            events.append({"type": "hallucinated"})
        elif not src["zone"]:
            events.append({"type": "spurious", "kind": src["label"], "position": src["position"]})
        elif best[src["position"]] is not pred:
            events.append({"type": "duplicate", "position": src["position"]})
        else:
            errors = {k: field_error(k, pred.get(k), src, messages)
                      for k in FIELDS if not same(pred.get(k), answer_value(k, src["fields"][k]))}
            events.append({"type": "found", "label": src["label"], "group": src["group"],
                           "position": src["position"], "wrong": {k: c for k, (c, _) in errors.items()},
                           "donors": {k: d for k, (_, d) in errors.items() if d}})
    # Zones are listed in message order, so one after the last listed in a truncated answer was cut off.
    claimed = {e["position"] for e in events if e["type"] == "found"}
    last = max((e["position"] for e in events if "position" in e), default=-1)
    for m in messages:
        if m["zone"] and m["position"] not in claimed:
            kind = "cut off" if status == "truncated" and m["position"] > last else "missed"
            events.append({"type": kind, "label": m["label"], "group": m["group"], "position": m["position"]})
    partial = status == "truncated" and text.rfind("{") > text.rfind("}")  # cut while writing one more zone
    kinds = Counter(m["label"] for m in messages if not m["zone"])
    return {"status": status, "partial": partial, "events": events, "kinds": dict(kinds)}


def decode(model, tokenizer, task_name: str, count: int, block_size: int, batch: int) -> dict:
    stops = stop_token_ids(tokenizer)
    grammars = Grammars(tokenizer, model.config.vocab_size, stops)
    examples = heldout_examples(tokenizer, task_name, count, 1 << 30)
    grammar = [answer_grammar(grammars, tasks.get_task(task_name), e.example, "schema") for e in examples]
    started, outputs = time.perf_counter(), [None] * count
    completions = _clover_completions(
        model, examples, stops, lambda i: grammars.constraint(grammar[i]),
        block_size=block_size, threshold=0.9, batch_size=batch, calibration=None,
    )  # fmt: skip
    for done, (index, generated, forwards) in enumerate(completions, 1):
        outputs[index] = {"text": tokenizer.decode(generated), "tokens": len(generated), "forwards": forwards}
        print(f"{task_name} B={block_size}: {done}/{count}", file=sys.stderr, flush=True)
    run = {"task": task_name, "block_size": block_size, "n": count, "prompts": outputs}
    return assess(tokenizer, run | {"seconds": round(time.perf_counter() - started, 1)})


def assess(tokenizer, run: dict) -> dict:
    """The checker's scores and the error analysis of a run's stored outputs (all --rescore redoes)."""
    task = tasks.get_task(run["task"])
    rows = []
    for encoded, out in zip(heldout_examples(tokenizer, run["task"], run["n"], 1 << 30), run["prompts"]):
        keep = {"seed": encoded.example.seed} | {k: out[k] for k in ("text", "tokens", "forwards")}
        rows.append(keep | analyse(task, encoded, out["text"], out["tokens"]))
        rows[-1]["checker"] = task.check(encoded.example, out["text"])
    checker = {k: round(sum(r["checker"][k] for r in rows) / len(rows), 4) for k in rows[0]["checker"]}
    return run | {"checker": checker, "summary": summarise(rows), "prompts": rows}


def summarise(rows: list[dict]) -> dict:
    events = [e for r in rows for e in r["events"]]
    found = [e for e in events if e["type"] == "found"]
    groups = {name: defaultdict(Counter) for name in ("zone_groups", "zone_phrasings")}
    for e in (e for e in events if e["type"] in TRUTH):
        hit = e["type"] == "found"
        for name, key in (("zone_groups", e["group"]), ("zone_phrasings", e["label"])):
            groups[name][key].update(n=1, found=int(hit), exact=int(hit and not e["wrong"]))
    shown = sum((Counter(r["kinds"]) for r in rows), Counter())
    listed = Counter(e["kind"] for e in events if e["type"] == "spurious")
    errors = {k: Counter(e["wrong"][k] for e in found if k in e["wrong"]) for k in FIELDS}
    # The budget bounds tokens, not zones: a prompt listing more zones than it has is cut off and scores 0.
    surplus = [r["partial"] + sum((e["type"] in LISTED) - (e["type"] in TRUTH) for e in r["events"])
               for r in rows]
    tokens, forwards = sum(r["tokens"] for r in rows), sum(r["forwards"] for r in rows)
    return {
        "outputs": dict(Counter(r["status"] for r in rows)),
        "prompts_listing": {"more": sum(d > 0 for d in surplus), "as many": sum(d == 0 for d in surplus),
                            "fewer": sum(d < 0 for d in surplus)},
        "tokens_per_forward": round(tokens / max(forwards, 1), 2),
        "zones": {"truth": sum(e["type"] in TRUTH for e in events), "found": len(found),
                  "exact": sum(not e["wrong"] for e in found),
                  "found, 3+ fields wrong": sum(len(e["wrong"]) >= 3 for e in found),
                  **{t: sum(e["type"] == t for e in events) for t in (*TRUTH[1:], *LISTED[1:])}},
        "field_right_of_found": {k: round(1 - v.total() / max(len(found), 1), 3) for k, v in errors.items()},
        "field_errors": {k: dict(v) for k, v in errors.items() if v},
        "donors": {k: dict(Counter(e["donors"][k] for e in found if k in e["donors"]).most_common())
                   for k in FIELDS},
        "distractors": {k: {"shown": shown[k], "listed": listed[k]} for k in sorted(shown)},
        **{name: {k: dict(v) for k, v in sorted(table.items())} for name, table in groups.items()},
    }


def table(runs: list[dict]) -> str:
    lines = ["metric".ljust(40) + "".join(f"{r['task'][7:]} B={r['block_size']}".rjust(20) for r in runs)]

    def row(name, cells):
        lines.append(name[:40].ljust(40) + "".join(str(c).rjust(20) for c in cells))

    ratio = lambda a, b: f"{a}/{b} {a / b:.2f}" if b else "-"
    sums = [r["summary"] for r in runs]
    for key in ("parsed", "count", "zone_exact_match"):
        row(f"checker {key}", [r["checker"][key] for r in runs])
    row("outputs parsed/truncated", [f"{s['outputs'].get('parsed', 0)}/{s['outputs'].get('truncated', 0)}"
                                     for s in sums])
    row("prompts listing more/same/fewer", ["/".join(map(str, s["prompts_listing"].values())) for s in sums])
    row("tokens per forward, seconds", [f"{s['tokens_per_forward']}, {r['seconds']:.0f}s"
                                        for s, r in zip(sums, runs)])
    for key in ("found", "exact", "found, 3+ fields wrong", *TRUTH[1:]):
        row(f"zones {key}", [ratio(s["zones"][key], s["zones"]["truth"]) for s in sums])
    for key in LISTED[1:]:
        row(f"listed {key}", [s["zones"][key] for s in sums])
    for key in FIELDS:
        row(f"field {key} right (of found)", [s["field_right_of_found"][key] for s in sums])
    sections = {"distractors": "distractor", "zone_groups": "zones", "zone_phrasings": "zone"}
    for section, title in sections.items():
        for key in sorted({k for s in sums for k in s[section]}):
            cells = [s[section].get(key) for s in sums]
            row(f"{title} {key}", ["-" if c is None else ratio(c["listed"], c["shown"]) if "listed" in c
                                   else f"{c['found']}/{c['exact']}/{c['n']}" for c in cells])
    lines.append("(distractor: listed/shown; zones: found/exact/n)")
    causes = [sum((Counter(v) for v in s["field_errors"].values()), Counter()) for s in sums]
    for cause in sorted(set().union(*causes)):
        row(f"wrong value: {cause}", [c[cause] for c in causes])
    ids = [s["donors"]["id"].items() for s in sums]
    row("id from another msg: within 2", [sum(v for d, v in i if abs(int(d.split()[0])) <= 2) for i in ids])
    row("id from another msg: distractor", [sum(v for d, v in i if d.endswith("distractor")) for i in ids])
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-clover")
    p.add_argument("--n", type=int, default=20, help="held-out no_fly_zones prompts (20 messages each)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--unseen", type=int, default=10, help="no_fly_zones_unseen prompts, last block size")
    p.add_argument("--batch", type=int, default=8, help="engine batch (evaluate_tasks' default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="runs/error_analysis.json")
    p.add_argument("--rescore", help="a report of this script: redo its analysis without decoding")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_folder_tokenizer(args.model)
    report = {"model": args.model, "dtype": str(inference_dtype()), "threads": args.threads, "runs": []}

    def save():  # after every run, so that a killed job keeps what it finished
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(table(report["runs"]), f"\nwrote {args.json}", flush=True)

    if args.rescore:  # the analysis changes faster than decoding is affordable on 2 cores
        with open(args.rescore) as f:
            report = json.load(f)
        report["runs"] = [assess(tokenizer, run) for run in report["runs"]]
        return save()
    model = load_model(args.model, inference_dtype())
    plan = [("no_fly_zones", args.n, b) for b in args.block_sizes if args.n]  # --n 0: the unseen family only
    plan += [("no_fly_zones_unseen", args.unseen, args.block_sizes[-1])] if args.unseen else []
    for name, count, block_size in plan:
        report["runs"].append(decode(model, tokenizer, name, count, block_size, args.batch))
        save()


if __name__ == "__main__":
    main()
