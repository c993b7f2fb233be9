"""The training campaign (`scripts/train_campaign.sh MINUTES`): every hour a machine has goes into the
shipped pair, session after session.

One call, resumable at every point:
1. Clover trains from its last checkpoint (the first time, warm-started from the shipped adapter) for its
   share of the minutes; the cosine schedule spans `schedule_steps` over all sessions.
2. The peer trains to the same step on the same batches (same seed and data), so the two stay at equal
   tokens.
3. Both candidates and the shipped pair are evaluated on one fixed held-out set (evaluation/campaign.py);
   the shipped pair's results are kept beside it (models/<name>/eval/campaign.json) and not recomputed.
4. A candidate replaces the shipped adapter only where it beats it beyond noise (`beats`): Clover then
   gets its block-size head refitted; the lineage (parent, steps, tokens) accumulates; models/README.md's
   campaign table is rewritten.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cloverlm.evaluation.campaign import CAMPAIGN_EVAL, evaluate_folder, paired_difference
from cloverlm.model.checkpoint import atomic_write_dir
from cloverlm.paths import MODELS
from cloverlm.training.conversion.chunks import train_here, train_in_chunks
from cloverlm.training.conversion.trainer import ConvertConfig, resolve_device
from cloverlm.training.loop import STATE_FILE

SHIPPED = {"diffusion": "smollm2-clover", "ar": "smollm2-peer"}
CANDIDATE_EVAL = "candidate_eval.json"  # a run's evaluation, point by point, beside its adapter folder
# no_fly keeps its 0.55, two fifths of it in composed phrasings (tasks/no_fly_varied.py): the seen family
# alone taught its sentences, not the reading (unseen zone exact 0.0 at step 535, models/README.md)
CAMPAIGN_MIXTURE = {
    "no_fly_zones": 0.33,
    "no_fly_zones_varied": 0.22,
    "tool_call": 0.15,
    "kv_retrieval": 0.05,
    "arithmetic": 0.05,
    "chat": 0.2,
}
# Per device: rows and clean tokens of a step (CUDA: several rows, padded; the CPU: two rows of 1,600).
STEP_SHAPE = {"cpu": (2, 1600), "cuda": (8, 4000)}
README_START, README_END = "<!-- campaign:start -->", "<!-- campaign:end -->"
# models/: a line per evaluated call of every run, so that the README keeps what each session measured and
# promoted (the run folders under runs/ are not kept by a new checkout)
HISTORY = "campaign_history.jsonl"
# The block-size head's refit on promotion: `clover calibrate`'s fit, as the shipped head was last fitted
# (models/README.md), judged on half its evaluation prompts (the campaign's own evaluation follows).
REFIT = {"eval_prompts": 4}


@dataclass
class CampaignConfig:
    minutes: float  # training minutes of this session (evaluation comes after)
    out: str = "runs/campaign"
    models: str = str(MODELS)  # the shipped folders: warm starts, baselines and promotions
    clover_share: float = 0.7  # of the minutes; the peer's step costs about half of Clover's
    schedule_steps: int = 3000  # the cosine's length over every session of this campaign
    prompts: int = 20
    device: str = "auto"
    seed: int = 3
    lr: float = 2e-4
    # None: the run's own (a new run: CAMPAIGN_MIXTURE). Given: what the run teaches from its next step on,
    # the one deliberate change to a campaign's data (e.g. more chat where the chat guard fell)
    mixture: dict[str, float] | None = None
    # None: the run's own (a new run: every record of data/chat_distill/train.jsonl). Given: the first N
    # records from the next step on (more records where the model had learnt the few it saw by heart)
    chat_examples: int | None = None
    # None: the run's own (a new run: 1). Given: masks drawn per answer block from the next step on
    # (ConvertConfig.noisy_draws)
    noisy_draws: int | None = None
    full_size_share: float = 0.6  # 20-message no_fly prompts: the size the targets are measured at
    # the two look-alikes the shipped model lists as zones most (18 of 19: docs/error_analysis.md)
    distractor_weights: dict[str, float] = field(
        default_factory=lambda: {"UAS EXEMPT": 2.0, "NO DRONE FLT": 2.0}
    )
    rows_per_step: int | None = None  # None: STEP_SHAPE of the device; a resumed run keeps its own
    tokens_per_step: int | None = None
    evaluate: bool = True
    promote: bool = True
    calibrate: bool = True  # refit Clover's block-size head when it is promoted
    command: str = ""  # the invocation, for the record: models/README.md lists every call of a run


def trainer_config(cfg: CampaignConfig, objective: str, device: str) -> ConvertConfig:
    """The trainer's configuration; a campaign that has begun keeps its data and step shape on any device
    (a resumed run must see the batches it would have seen), whatever the defaults are now."""
    name = SHIPPED[objective]
    rows, tokens = STEP_SHAPE[device]
    data = {"rows_per_step": cfg.rows_per_step or rows, "tokens_per_step": cfg.tokens_per_step or tokens,
            "mixture": dict(CAMPAIGN_MIXTURE), "full_size_share": cfg.full_size_share,
            "distractor_weights": dict(cfg.distractor_weights), "chat_examples": None,
            "noisy_draws": ConvertConfig.noisy_draws}  # fmt: skip
    state = Path(cfg.out) / name / "checkpoint" / STATE_FILE
    if state.is_file():
        stored = asdict(ConvertConfig()) | json.loads(state.read_text())["config"]
        data = {key: stored[key] for key in data}
    # what a new run starts with, or a begun one teaches from its next step on (trainer.RESUME_MAY_CHANGE)
    changes = {"mixture": dict(cfg.mixture or {}), "chat_examples": cfg.chat_examples, "noisy_draws": cfg.noisy_draws}
    data |= {key: value for key, value in changes.items() if value}
    return ConvertConfig(
        objective=objective, out=str(Path(cfg.out) / name), seed=cfg.seed, **data, lr=cfg.lr, warmup_steps=10,
        max_steps=cfg.schedule_steps, eval_every=100, checkpoint_every=10, device=cfg.device,
        init_adapter=str(Path(cfg.models) / name),
    )  # fmt: skip


def _train(convert_cfg: ConvertConfig, minutes: float | None, stop_at: int | None = None) -> dict:
    convert_cfg.minutes = minutes
    if resolve_device(convert_cfg.device).type == "cpu":  # a fresh heap every few steps (chunks.py)
        return train_in_chunks(convert_cfg, stop_at)
    return train_here(convert_cfg, stop_at)


def beats(candidate: dict, shipped: dict, primary: list[str], guards: list[str]) -> dict:
    """Whether `candidate` is better than `shipped` beyond noise: on the primary points, paired prompt by
    prompt, the mean gain is above twice its standard error; and no guard point falls by more than twice
    its own. Returns the decision and every difference."""
    gain = paired_difference(candidate, shipped, primary)
    drops = {point: paired_difference(candidate, shipped, [point]) for point in guards}
    better = gain["mean"] > 2 * gain["stderr"] and gain["mean"] > 0
    held = all(d["mean"] >= -2 * d["stderr"] for d in drops.values())
    return {"promote": better and held, "primary": gain, "guards": drops}


def _promote(run_out: Path, folder: Path, report: dict, calibrate: bool) -> None:
    """The run's adapter, its log lines and its evaluation go into the shipped folder (swapped in whole);
    the rest of the folder (its older eval reports, the block-size head until it is refitted) stays."""

    def write(target: Path) -> None:
        shutil.copytree(folder, target, dirs_exist_ok=True)
        for file in (run_out / "adapter").iterdir():
            shutil.copy2(file, target / file.name)
        log = (folder / "train_log.jsonl").read_text() if (folder / "train_log.jsonl").is_file() else ""
        (target / "train_log.jsonl").write_text(log + _campaign_log(run_out, log))
        (target / "eval").mkdir(exist_ok=True)
        (target / "eval" / CAMPAIGN_EVAL).write_text(json.dumps(report, indent=1) + "\n")

    atomic_write_dir(folder, write)
    if calibrate:
        from cloverlm.convert.load import load_folder_tokenizer, load_model
        from cloverlm.model.checkpoint import inference_dtype
        from cloverlm.training.calibrate import calibrate as fit

        model = load_model(folder, inference_dtype())
        calibration, fit_report = fit(model, load_folder_tokenizer(folder), **REFIT)
        calibration.save(folder, extra=fit_report)


def _campaign_log(run_out: Path, shipped_log: str) -> str:
    """The run's log lines not already in the shipped log (a run promoted twice is appended once)."""
    marker = f'"campaign": "{run_out}"'
    lines = (run_out / "train_log.jsonl").read_text().splitlines()
    seen = {line for line in shipped_log.splitlines() if marker in line}
    tagged = [line[:-1] + f", {marker}}}" for line in lines if line.endswith("}")]
    return "".join(line + "\n" for line in tagged if line not in seen)


def _readme_table(results: dict) -> str:
    rows = ["| model | tokens in all | no_fly B=1 | no_fly B=16 (TPF) | unseen B=16 | tool_call B=16 | chat agreement | promoted |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, entry in results.items():
        for label in ("shipped", "candidate"):
            r = entry[label]
            rows.append(
                f"| {name} ({label}) | {r.get('total_tokens') or '?'} | {r.get('no_fly_b1', '-')} | {r.get('no_fly_b16', '-')}"
                f"{' (' + str(r['no_fly_b16_tpf']) + ')' if 'no_fly_b16_tpf' in r else ''} | {r.get('unseen_b16', '-')} "
                f"| {r.get('tool_call_b16', '-')} | {r.get('chat', '-')} | {entry['decision']['promote'] if label == 'candidate' else ''} |"
            )
    return "\n".join(rows)


def _history_table(history: list[dict]) -> str:
    """A row per model and call: its candidate's scores, its paired no_fly gain and whether it was promoted."""
    rows = ["| date | model | tokens in all | no_fly B=1 | no_fly B=16 | unseen | tool_call | chat | paired gain (stderr) | promoted |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for call in history:
        for name, entry in call["results"].items():
            r, gain = entry["candidate"], entry["decision"]["primary"]
            rows.append(
                f"| {call['date']} | {name} | {r.get('total_tokens') or '?'} | {r.get('no_fly_b1', '-')} | {r.get('no_fly_b16', '-')} "
                f"| {r.get('unseen_b16', r.get('unseen_b1', '-'))} | {r.get('tool_call_b16', r.get('tool_call_b1', '-'))} "
                f"| {r.get('chat', '-')} | {gain['mean']:+.3f} ({gain['stderr']:.3f}) | {'yes' if entry['decision']['promote'] else 'no'} |"
            )
    return "\n".join(rows)


def _command(call: dict) -> str:
    """A call's command line as recorded; calls recorded before commands were kept give their minutes."""
    return call.get("command") or f"scripts/train_campaign.sh {call['minutes']:g}"


def _update_readme(models: Path, summary: dict, earlier: list[dict] = ()) -> None:
    """Rewrite models/README.md's campaign section from this call's `summary`; `earlier`: the run's calls
    before it (sessions.jsonl), whose commands are listed first, so the record says how the run was made."""
    readme, history_file = models / "README.md", models / HISTORY
    text = readme.read_text() if readme.is_file() else ""
    line = {key: summary[key] for key in ("date", "device", "results")} | {"command": _command(summary)}
    with open(history_file, "a") as handle:
        handle.write(json.dumps(line) + "\n")
    history = [json.loads(row) for row in history_file.read_text().splitlines() if row.strip()]
    calls = [f"`{_command(call)}`" for call in (*earlier, summary)]
    body = (f"{README_START}\n## The training campaign, last session ({summary['date']})\n\n"
            f"{', then '.join(calls)}, on {summary['device']}, mixture "
            f"{','.join(f'{k}={v:g}' for k, v in summary.get('mixture', {}).items()) or '-'}, chat records: "
            f"{summary.get('chat_examples') or 'all'}, noisy draws per block: {summary.get('noisy_draws', 1)}; 20 held-out prompts a point, "
            f"20 messages, threshold 0.9, under the answer schema (evaluation/campaign.py). Promotion: the paired gain "
            f"on the no_fly points above twice its standard error, tool_call and chat not down by more than twice theirs.\n\n"
            f"{_readme_table(summary['results'])}\n\nEvery evaluated call so far, oldest first ({HISTORY}; the candidate's "
            f"scores, its paired gain on the no_fly points):\n\n{_history_table(history)}\n{README_END}")  # fmt: skip
    if README_START in text:
        text = text[: text.index(README_START)] + body + text[text.index(README_END) + len(README_END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    readme.write_text(text)


def _earlier_calls(out: Path) -> list[dict]:
    """The run's calls so far, one summary a line of out/sessions.jsonl, oldest first."""
    log = out / "sessions.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


def run_campaign(cfg: CampaignConfig) -> dict:
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    out, models = Path(cfg.out), Path(cfg.models)
    out.mkdir(parents=True, exist_ok=True)
    (out / "campaign.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    started = time.time()
    clover_cfg, peer_cfg = trainer_config(cfg, "diffusion", device), trainer_config(cfg, "ar", device)
    clover = _train(clover_cfg, cfg.minutes * cfg.clover_share)
    peer = _train(peer_cfg, None, stop_at=clover["steps"])
    summary = {"date": time.strftime("%Y-%m-%d"), "minutes": cfg.minutes, "command": cfg.command, "mixture": clover_cfg.mixture,
               "chat_examples": clover_cfg.chat_examples, "noisy_draws": clover_cfg.noisy_draws, "device": clover["device"],
               "train_seconds": round(time.time() - started), "clover": clover, "peer": peer, "results": {}}  # fmt: skip
    if cfg.evaluate:
        for objective, trained in (("diffusion", clover), ("ar", peer)):
            name = SHIPPED[objective]
            # the shipped folder's cached scores are written only by a campaign that may change the folder
            shipped = evaluate_folder(models / name, cfg.prompts, cache=True, write_cache=cfg.promote)
            # cached beside the run (its adapter folder is rewritten whole): `--minutes 0` finishes a cut evaluation
            candidate = evaluate_folder(
                Path(trained["out"]), cfg.prompts, cache=True, cache_file=out / name / CANDIDATE_EVAL
            )
            primary = (
                ["no_fly_b1", "no_fly_b16", "unseen_b16"]
                if objective == "diffusion"
                else ["no_fly_b1", "unseen_b1"]
            )
            guards = ["tool_call_b16" if objective == "diffusion" else "tool_call_b1", "chat"]
            decision = beats(candidate, shipped, primary, guards)
            summary["results"][name] = {
                "shipped": shipped["summary"],
                "candidate": candidate["summary"],
                "decision": decision,
            }
            if cfg.promote and decision["promote"]:
                _promote(out / name, models / name, candidate, cfg.calibrate and objective == "diffusion")
        if cfg.promote:
            _update_readme(models, summary, _earlier_calls(out))
    summary["seconds"] = round(time.time() - started)
    with open(out / "sessions.jsonl", "a") as handle:
        handle.write(json.dumps(summary) + "\n")
    return summary


def add_arguments(parser) -> None:
    """`clover campaign`'s options, shared by the CLI and scripts/gpu_window/run_campaign.py (the GPU
    machine cannot import the CLI: it lacks the server's packages)."""
    parser.add_argument(
        "--minutes", type=float, required=True, help="training minutes (evaluation comes after)"
    )
    parser.add_argument("--out", default=CampaignConfig.out)
    parser.add_argument(
        "--models", default=CampaignConfig.models, help="the shipped folders: warm starts and promotions"
    )
    parser.add_argument("--device", default=CampaignConfig.device, choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--prompts", type=int, default=CampaignConfig.prompts, help="held-out prompts per evaluation point"
    )
    parser.add_argument(
        "--rows-per-step",
        type=int,
        help="a new campaign's step shape (default: 2 x 1,600 on CPU, 8 x 4,000 on CUDA)",
    )
    parser.add_argument("--tokens-per-step", type=int, help="clean tokens per row of a new campaign")
    parser.add_argument("--threads", type=int)
    parser.add_argument(
        "--mixture",
        type=parse_mixture,
        help="source=weight,... from the next step on "
        f"(default: the run's own; a new run's: {','.join(f'{k}={v}' for k, v in CAMPAIGN_MIXTURE.items())})",
    )
    parser.add_argument(
        "--chat-examples", type=int, help="chat records the run draws from, from the next step on (default: the run's own)"
    )
    parser.add_argument(
        "--noisy-draws", type=int, help="masks drawn per answer block, from the next step on (default: the run's own)"
    )
    parser.add_argument(
        "--lr", type=float, default=CampaignConfig.lr, help="a new run's peak learning rate (a begun run keeps its own)"
    )
    parser.add_argument(
        "--schedule-steps",
        type=int,
        default=CampaignConfig.schedule_steps,
        help="the cosine's length over every session of the run; the run ends there (e.g. a session's steps, to decay within it)",
    )
    parser.add_argument("--no-eval", action="store_true", help="train only (no evaluation, no promotion)")
    parser.add_argument(
        "--no-promote", action="store_true", help="evaluate but leave the shipped folders as they are"
    )


def parse_mixture(text: str) -> dict[str, float]:
    """'no_fly_zones=0.5,chat=0.3' -> {"no_fly_zones": 0.5, "chat": 0.3} (the sources are checked by the data)."""
    try:
        mixture = {
            name.strip(): float(weight) for name, weight in (part.split("=") for part in text.split(","))
        }
    except ValueError:
        raise argparse.ArgumentTypeError(f"a mixture is source=weight,... (got {text!r})") from None
    if not mixture or any(w < 0 for w in mixture.values()) or not sum(mixture.values()) > 0:
        raise argparse.ArgumentTypeError(f"a mixture needs weights >= 0 with a positive sum (got {text!r})")
    return mixture


def config_from_args(args) -> CampaignConfig:
    """The campaign of parsed `add_arguments` options; its command is this process's command line."""
    return CampaignConfig(minutes=args.minutes, out=args.out, models=args.models, device=args.device, prompts=args.prompts,
                          rows_per_step=args.rows_per_step, tokens_per_step=args.tokens_per_step, mixture=args.mixture,
                          chat_examples=args.chat_examples, noisy_draws=args.noisy_draws, lr=args.lr,
                          schedule_steps=args.schedule_steps, evaluate=not args.no_eval, promote=not args.no_promote,
                          command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]))  # fmt: skip


def run_from_args(args) -> dict:
    """Run the campaign of parsed `add_arguments` options."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return run_campaign(config_from_args(args))
