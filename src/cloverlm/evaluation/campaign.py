"""The training campaign's fixed held-out set (training/conversion/campaign.py): the points the issue's targets are
measured at, each prompt's score kept so that two models compare prompt by prompt.

Points, 20 prompts each by default, no_fly prompts of 20 messages, threshold 0.9, under the answers'
schemas: Clover at B = 1 and B = 16 on no_fly_zones, at B = 16 on the held-out phrasing family
(no_fly_zones_unseen) and on tool_call; the peer one token a step on the same three; both on chat (the
teacher-forced agreement with the base's own answers, evaluation/chat.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path

from cloverlm.evaluation.chat import read_chat, teacher_forced_agreement
from cloverlm.evaluation.evaluate import evaluate_tasks

CAMPAIGN_EVAL = "campaign.json"
EVAL_VERSION = 2  # bump when the points or their settings change: cached results are then recomputed
# The points decode under the plain schema (issue 28's targets were set there); the json_guard rules and
# budget-aware closing came with version 2.
ANSWERS = "schema"
THRESHOLD = 0.9
SIZES = {"no_fly_zones": {"n_messages": 20}, "no_fly_zones_unseen": {"n_messages": 20}}
METRIC = {"no_fly_zones": "zone_exact_match", "no_fly_zones_unseen": "zone_exact_match", "tool_call": "exact"}
# point -> (task, block size); the peer decodes one token a step, so its points are the B = 1 ones
CLOVER_POINTS = {"no_fly_b1": ("no_fly_zones", 1), "no_fly_b16": ("no_fly_zones", 16),
                 "unseen_b16": ("no_fly_zones_unseen", 16), "tool_call_b16": ("tool_call", 16)}  # fmt: skip
PEER_POINTS = {
    "no_fly_b1": ("no_fly_zones", 1),
    "unseen_b1": ("no_fly_zones_unseen", 1),
    "tool_call_b1": ("tool_call", 1),
}
# Points whose decoding changed since EVAL_VERSION, per model: only their cached scores are recomputed (a
# pair's evaluation is two hours of CPU). 3: near the budget, the grammar's narrowed mask no longer makes a
# token look certain (Clover's threshold rule, B > 1: decoding/unmask.py) or forced (the peer: convert/peer.py).
# 4 (Clover, B > 1): the engine no longer holds choices right of a grammar's reach (Engine's lookahead).
POINT_VERSIONS = {"clover": {point: 4 for point, (_, block_size) in CLOVER_POINTS.items() if block_size > 1},
                  "peer": {point: 3 for point in PEER_POINTS}}  # fmt: skip


def point_version(point: str, peer: bool) -> int:
    return POINT_VERSIONS["peer" if peer else "clover"].get(point, EVAL_VERSION)


def _key(folder: Path, prompts: int) -> dict:
    digest = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]
    return {"version": EVAL_VERSION, "prompts": prompts, "adapter_sha256": digest}


def evaluate_folder(
    folder: str | Path,
    prompts: int = 20,
    cache: bool = False,
    write_cache: bool = True,
    cache_file: Path | None = None,
) -> dict:
    """{"points": {point: [score per prompt]}, "summary": {point: mean, ...}, "key": ...} for an adapter
    folder (Clover or the peer). cache=True reads folder/eval/campaign.json (or `cache_file`) where it holds
    this adapter's scores at these prompts, and (write_cache) writes each point there as it is computed: an
    evaluation cut short (an hour of CPU for a pair of models) resumes at the first point it lacks."""
    from cloverlm.convert.adapter import adapter_meta
    from cloverlm.convert.load import load_folder_tokenizer, load_model
    from cloverlm.convert.peer import is_peer_folder, load_peer
    from cloverlm.model.checkpoint import inference_dtype

    folder = Path(folder)
    key, cached = _key(folder, prompts), cache_file or folder / "eval" / CAMPAIGN_EVAL
    stored = json.loads(cached.read_text()) if cache and cached.is_file() else {}
    stored = stored if stored.get("key") == key else {}
    peer = is_peer_folder(folder)
    wanted = PEER_POINTS if peer else CLOVER_POINTS
    versions = stored.get("versions", {})  # a cache written before point versions holds EVAL_VERSION's
    stale = {point for point in stored.get("points", {}) if versions.get(point, EVAL_VERSION) != point_version(point, peer)}
    points = {point: scores for point, scores in stored.get("points", {}).items() if point not in stale}
    summary = {name: value for name, value in stored.get("summary", {}).items()
               if not any(name == point or name.startswith(point + "_") for point in stale)}  # fmt: skip
    result = {"key": key, "folder": str(folder), "points": points, "summary": summary,
              "versions": {point: point_version(point, peer) for point in points}}  # fmt: skip

    def keep() -> None:
        result["versions"] = {point: point_version(point, peer) for point in points}
        if cache and write_cache:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps(result, indent=1) + "\n")

    if set(points) >= set(wanted) | {"chat"}:
        return result
    model = load_peer(folder, inference_dtype()) if peer else load_model(folder, inference_dtype())
    tokenizer = load_folder_tokenizer(folder)
    for point, (task, block_size) in wanted.items():
        if point in points:
            continue
        report = evaluate_tasks(model, tokenizer, [task], prompts, block_size=block_size, threshold=THRESHOLD,
                                sizes=SIZES, answers=ANSWERS, per_prompt=True)[task]  # fmt: skip
        points[point] = [score[METRIC[task]] for score in report["per_prompt"]]
        summary[point] = round(statistics.mean(points[point]), 4)
        if block_size > 1:
            summary[f"{point}_tpf"] = report["tokens_per_forward"]
        summary[f"{point}_seconds"] = report["seconds"]
        keep()
    points["chat"] = teacher_forced_agreement(model, tokenizer, read_chat("heldout")[:prompts])
    summary["chat"] = round(statistics.mean(points["chat"]), 4)
    meta = adapter_meta(folder)
    summary |= {"total_tokens": meta.get("total_tokens"), "total_steps": meta.get("total_steps")}
    keep()
    return result


def paired_difference(a: dict, b: dict, points: list[str]) -> dict:
    """Mean and standard error of a's score minus b's, prompt by prompt over the given points."""
    diffs = [x - y for point in points for x, y in zip(a["points"][point], b["points"][point], strict=True)]
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("inf")
    return {"mean": round(statistics.mean(diffs), 4), "stderr": round(stderr, 4), "pairs": len(diffs)}
