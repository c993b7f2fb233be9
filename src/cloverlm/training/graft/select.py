"""Which layers of a graft stay attention (issue 30, item 3): `clover graft-select`; and how close a graft
has come to its teacher on the same measures (`clover graft-eval`, `evaluate_students`).

Rather than keeping every fourth layer, each candidate is scored the way "Distilling to Hybrid Attention
Models via KL-Guided Layer Selection" does: restore one layer at a time to the teacher's attention
(convert/graft.py `restore_attention`) and measure how much closer the student comes to the teacher. The
paper found that the layers worth keeping cluster mid to late, not at a fixed stride. KL alone under-weights
recall: Jet-Nemotron found that retrieval rests on a few full-attention layers, and pure linear conversions
fail passkey retrieval first, while recall tokens are a small share of ordinary text. So every candidate is
also scored on two recall probes.

Measures, all teacher-forced at block size 1 (each token predicted from the text before it, as the engine
decodes at B = 1 and as the base does: docs/design.md invariants 5 and 7), on fixed data for a seed:
- kl: mean over held-out tokens of KL(teacher || model), on packed rows of the conversion trainer's mixture
  (ConversionData, the sampler stage 1 trains on, drawn under this module's own seed strings).
- kv: teacher-forced accuracy of the value tokens of held-out `kv_retrieval` answers (60 pairs a prompt).
  Only the values are scored: the keys and the JSON around them stand in the question just before.
- needle: the same on one key-value pair placed at a depth of a haystack of held-out chat answers
  (data/chat_distill/heldout.jsonl), with kv_retrieval's question, at each context length (1k-4k tokens).

Scoring rule: score = kl_gain + recall_gain, where kl_gain = (kl_base - kl) / kl_base is the share of the
student's KL (all or mostly memory) that restoring the layer removes, and recall_gain = (recall - recall_base) /
(recall_teacher - recall_base) the share of the recall gap to the teacher it closes (recall: the mean of kv
and needle; 0 for every layer where the teacher recalls no better than the student). Both are shares of the
distance to the teacher, so they add without a tuned weight: a layer that closes half the recall gap counts
as much as one that removes half the KL. Candidates are ranked by score (rounded to 1e-9) and then by layer
index, and the best `keep` become attention. Ranking costs one evaluation a candidate; a greedy search would
cost `keep` times as many.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cloverlm import tasks
from cloverlm.convert.graft import check_graft_of, grafted_layers, restore_attention
from cloverlm.convert.graft_folder import trained_runs
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.errors import CloverError
from cloverlm.evaluation.chat import read_chat
from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE, encode_example
from cloverlm.model.cache import CloverCache
from cloverlm.model.checkpoint import atomic_write_dir, multiplies_bf16, save_model
from cloverlm.model.config import MEMORY
from cloverlm.training.conversion.config import ConvertConfig
from cloverlm.training.conversion.data import ConversionData
from cloverlm.training.conversion.trainer import device_label, resolve_device

REPORT_FILE = "graft_select.json"
EVAL_FILE = "graft_eval.json"
PLOT_FILE = "graft_select.png"
HYBRID_DIR = "hybrid"
RULE = "score = (kl_base - kl) / kl_base + (recall - recall_base) / (recall_teacher - recall_base); recall = mean(kv, needle)"


@dataclass
class SelectConfig:
    teacher: str = ""  # the all-attention model (plain Clover or adapter folder)
    student: str = ""  # its graft after stage 1 (all or mostly memory)
    out: str = "runs/graft-select"
    keep: int = 8  # candidates restored to attention
    seed: int = 0
    tokens: int = 2048  # held-out tokens of the KL, in rows of seq_len
    seq_len: int = 512
    kv_prompts: int = 8
    needle_contexts: tuple[int, ...] = (1024, 4096)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    mixture: dict[str, float] = field(default_factory=lambda: ConvertConfig().mixture)  # the conversion trainer's
    device: str = "cpu"
    bf16: bool | None = None  # None: bf16 where the hardware multiplies it, as stage 1's teacher
    save_hybrid: bool = False  # also write OUT/hybrid: the student with the chosen layers restored (fp32)


@dataclass(frozen=True)
class Probe:
    """A prompt and its answer as token ids, and the answer positions whose tokens are scored."""

    ids: list[int]
    targets: list[int]
    context: int = 0  # the needle's context length (0: a kv_retrieval prompt)


@dataclass(frozen=True)
class Probes:
    text: torch.Tensor  # [rows, seq_len] held-out text for the KL
    kv: list[Probe]
    needle: list[Probe]


def _values_only(example: tasks.Example) -> tasks.Example:
    """kv_retrieval's value_spans alternate key, value (in the answer's order): keep the values."""
    return replace(example, value_spans=example.value_spans[1::2])


def _probe(tokenizer, example: tasks.Example, context: int = 0) -> Probe:
    encoded = encode_example(tokenizer, _values_only(example))
    return Probe(encoded.ids, encoded.value_positions, context)


def _needles(tokenizer, cfg: SelectConfig, rng: random.Random) -> list[Probe]:
    """One key-value pair at each depth of each context's haystack, asked as kv_retrieval asks it. The
    haystack: held-out chat answers in a seeded order (cycled when they run out), the last one cut to fit."""
    answers = [record["answer"].strip() for record in read_chat("heldout")]
    rng.shuffle(answers)
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in answers]
    probes = []
    for context in cfg.needle_contexts:
        for depth in cfg.needle_depths:
            example = tasks.generate("kv_retrieval", HELDOUT_SEED_BASE + rng.randrange(10**9), n_pairs=1)
            pair, question = example.prompt.split("\n")
            room = context - len(encode_example(tokenizer, example).ids)
            haystack, sizes = [], []
            while room > 1:  # one token of each paragraph's room goes to the blank line before it
                tokens = encoded[len(haystack) % len(encoded)][: room - 1]
                haystack.append(tokenizer.decode(tokens))
                sizes.append(len(tokens))
                room -= len(tokens) + 1
            running = [sum(sizes[: n + 1]) for n in range(len(sizes))]
            at = sum(r <= depth * sum(sizes) for r in running)  # paragraphs before the needle
            prompt = "\n\n".join([*haystack[:at], pair, *haystack[at:], question])
            probes.append(_probe(tokenizer, replace(example, prompt=prompt), context))
    return probes


def build_probes(tokenizer, cfg: SelectConfig) -> Probes:
    """The fixed data of a selection: a pure function of (tokenizer, cfg)."""
    if cfg.tokens < cfg.seq_len or cfg.seq_len < 2:
        raise CloverError(f"--tokens ({cfg.tokens}) must hold at least one row of seq_len ({cfg.seq_len}) tokens")
    data = ConversionData(tokenizer, ConvertConfig(seed=cfg.seed, mixture=cfg.mixture))
    rows = []
    for row in range(cfg.tokens // cfg.seq_len):  # stage 1's packing, under other seeds than its steps'
        rng, ids = random.Random(f"graft-select/{cfg.seed}/{row}"), []
        while len(ids) < cfg.seq_len:
            segment = data.sample(rng)
            ids += segment.prompt + segment.answer
        rows.append(ids[: cfg.seq_len])
    rng = random.Random(f"graft-select/{cfg.seed}/probes")
    seeds = [HELDOUT_SEED_BASE + rng.randrange(10**9) for _ in range(cfg.kv_prompts)]
    kv = [_probe(tokenizer, tasks.generate("kv_retrieval", s)) for s in seeds]
    return Probes(torch.tensor(rows), kv, _needles(tokenizer, cfg, rng))


@torch.no_grad()
def mean_kl(model, teacher, teacher_hidden: list[torch.Tensor], text: torch.Tensor) -> float:
    """Mean over every token of `text` of KL(teacher || model) of the next token at block size 1 (the
    forward of one sequence, noisy stream = clean stream: its B = 1 prediction). The teacher's logits come
    from its stored final hidden states, so one row's vocabulary-sized logits are alive at a time."""
    total = 0.0
    for hidden, ids in zip(teacher_hidden, text):
        want = _log_probs(teacher, hidden)
        got = F.log_softmax(model(ids[None].to(model.device)).logits[0].float(), dim=-1)
        total += float((want.exp() * (want - got)).sum())
    return total / text.numel()


def _log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model.lm_head(hidden).float(), dim=-1)


@torch.no_grad()
def next_token_logits(model, ids: list[int], targets: list[int]) -> torch.Tensor:
    """[len(targets), V]: the logits that predict ids[t] for each t of `targets` (ascending, t >= 2), as the
    engine decodes at block size 1: the prefix prefilled, then one token committed and the next stepped at a
    time. Not the clean stream of the whole text: memory layers' centred conv lets a committed token see
    the tokens after it. Only the answer's few positions pay a step, so a 4k-token needle costs a prefill."""
    device, first = model.device, targets[0] - 1
    cache = CloverCache.empty(model.config, 1, device)
    model.prefill(torch.tensor([ids[:first]], device=device), [1] * first, cache)
    cache.reserve(targets[-1] + 1)
    logits = {}
    for t in range(first, targets[-1]):
        commit = None if t == first else torch.tensor([ids[t - 1 : t]], device=device)
        out = model.decode(cache, commit_ids=commit, step_ids=torch.tensor([ids[t : t + 1]], device=device))
        if t + 1 in targets:
            logits[t + 1] = out.logits[0, 0]
    return torch.stack([logits[t] for t in targets])


def accuracy(model, probes: list[Probe]) -> float:
    """Teacher-forced accuracy over all probes' scored tokens, pooled."""
    right = count = 0
    for probe in probes:
        predicted = next_token_logits(model, probe.ids, probe.targets).argmax(-1).cpu()
        right += int((predicted == torch.tensor([probe.ids[t] for t in probe.targets])).sum())
        count += len(probe.targets)
    return right / max(count, 1)


def recall_scores(model, probes: Probes) -> dict:
    kv = accuracy(model, probes.kv)
    by_context = {str(c): accuracy(model, [p for p in probes.needle if p.context == c]) for c in sorted({p.context for p in probes.needle})}
    needle = sum(by_context.values()) / len(by_context) if by_context else None
    return {"kv": kv, "needle": needle, "needle_by_context": by_context, "recall": kv if needle is None else (kv + needle) / 2}


def combined_score(scores: dict, baseline: dict, teacher: dict) -> dict:
    """The rule of the module docstring: kl_gain + recall_gain."""
    kl_gain = (baseline["kl"] - scores["kl"]) / baseline["kl"] if baseline["kl"] > 0 else 0.0
    gap = teacher["recall"] - baseline["recall"]
    recall_gain = (scores["recall"] - baseline["recall"]) / gap if gap > 0 else 0.0
    return {"kl_gain": kl_gain, "recall_gain": recall_gain, "score": round(kl_gain + recall_gain, 9)}


def rank(candidates: list[dict]) -> list[int]:
    """Layers best first: by score, then by layer index (a tie never depends on the order of evaluation)."""
    return [c["layer"] for c in sorted(candidates, key=lambda c: (-c["score"], c["layer"]))]


class Judge:
    """The teacher and the fixed probes of a config, and how a model measures against them: what
    `select_layers` and `evaluate_students` share."""

    def __init__(self, cfg: SelectConfig):
        self.device = resolve_device(cfg.device)
        self.dtype = torch.bfloat16 if (multiplies_bf16(self.device) if cfg.bf16 is None else cfg.bf16) else torch.float32
        self.teacher = load_model(cfg.teacher, self.dtype).to(self.device)
        self.tokenizer = load_folder_tokenizer(cfg.teacher)
        self.probes = build_probes(self.tokenizer, cfg)
        with torch.no_grad():
            self.teacher_hidden = [self.teacher(ids[None].to(self.device)).hidden_states[0] for ids in self.probes.text]

    def load(self, folder: str):
        return load_model(folder, self.dtype).to(self.device)

    def teacher_scores(self) -> dict:
        """The teacher's own recall: what a student's is a share of."""
        return recall_scores(self.teacher, self.probes)

    def measure(self, model) -> dict:
        kl = mean_kl(model, self.teacher, self.teacher_hidden, self.probes.text)
        if not math.isfinite(kl):  # a NaN would rank anywhere: say so instead
            raise CloverError(f"the student's KL against the teacher is {kl}: its logits are not finite")
        return {"kl": kl, **recall_scores(model, self.probes)}

    def about(self) -> dict:
        """What a report says of its data and machine."""
        probes = self.probes
        return {"data": {"kl_tokens": probes.text.numel(), "kv_tokens": sum(len(p.targets) for p in probes.kv),
                         "needles": [{"context": p.context, "tokens": len(p.ids), "scored": len(p.targets)} for p in probes.needle]},
                "device": device_label(self.device), "dtype": str(self.dtype).removeprefix("torch.")}  # fmt: skip


def evaluate_students(cfg: SelectConfig, students: list[str], progress: bool = True) -> dict:
    """Each student's held-out KL against cfg.teacher and its recall beside the teacher's, on the probes of
    a selection (`clover graft-eval`): how far stage 1 or 2 has brought the all-memory and hybrid students.
    Writes cfg.out/EVAL_FILE; returns the report."""
    start = time.time()
    judge = Judge(cfg)
    teacher = judge.teacher_scores()
    rows = []
    for folder in tqdm(students, desc="students", disable=not progress, dynamic_ncols=True):
        student = judge.load(folder)
        check_graft_of(judge.teacher, student)
        scores = judge.measure(student)
        kinds = student.config.layer_types
        # which training state was measured: a graft folder's record moves on with every checkpoint
        rows.append({"student": folder, "trained": trained_runs(folder),
                     "memory_layers": [i for i, kind in enumerate(kinds) if kind == MEMORY], **scores,
                     **{f"{key}_of_teacher": share_of(scores[key], teacher[key]) for key in ("kv", "needle", "recall")}})  # fmt: skip
    probes_config = {k: v for k, v in asdict(cfg).items() if k not in ("student", "keep", "save_hybrid")}
    report = {"teacher": cfg.teacher, "config": probes_config, "teacher_scores": teacher, "students": rows,
              **judge.about(), "seconds": round(time.time() - start, 1)}  # fmt: skip
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / EVAL_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report


def share_of(value: float | None, teacher: float | None) -> float | None:
    """value / teacher: a recall as a share of the teacher's (None where either is missing or the teacher's is 0)."""
    return None if value is None or not teacher else value / teacher


def select_layers(cfg: SelectConfig, progress: bool = True) -> dict:
    """Score every candidate, choose `keep`, write the report and the plot into cfg.out; returns the report."""
    start = time.time()
    judge = Judge(cfg)
    student = judge.load(cfg.student)
    candidates_layers = grafted_layers(judge.teacher, student)
    if not 1 <= cfg.keep <= len(candidates_layers):
        raise CloverError(f"--keep must be between 1 and the {len(candidates_layers)} candidate layers, got {cfg.keep}")
    teacher_scores = judge.teacher_scores()
    baseline = judge.measure(student)
    candidates = []
    for layer in tqdm(candidates_layers, desc="candidates", disable=not progress, dynamic_ncols=True):
        scores = judge.measure(restore_attention(student, judge.teacher, [layer]))
        candidates.append({"layer": layer, **scores, **combined_score(scores, baseline, teacher_scores)})
    order = rank(candidates)
    chosen = sorted(order[: cfg.keep])
    for candidate in candidates:
        candidate["rank"] = order.index(candidate["layer"]) + 1
    memory = [i for i in candidates_layers if i not in chosen]
    about = judge.about()
    report = {
        "teacher": cfg.teacher, "student": cfg.student, "config": asdict(cfg), "rule": RULE, "data": about.pop("data"),
        "teacher_scores": teacher_scores, "baseline": baseline, "candidates": candidates, "chosen": chosen,
        "attention_layers": [i for i, kind in enumerate(student.config.layer_types) if kind != MEMORY or i in chosen],
        "memory_layers": memory, "memory_layers_arg": ",".join(map(str, memory)),
        "selected": judge.measure(restore_attention(student, judge.teacher, chosen)),  # the chosen layers restored together
        **about, "seconds": round(time.time() - start, 1),
    }  # fmt: skip
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.save_hybrid:  # stage 1's trained mixers kept, unlike a fresh graft of the teacher; in fp32 for stage 2
        hybrid = restore_attention(load_model(cfg.student), load_model(cfg.teacher), chosen)
        atomic_write_dir(out / HYBRID_DIR, lambda folder: save_model(hybrid, judge.tokenizer, folder))
        report["hybrid"] = str(out / HYBRID_DIR)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    plot_scores(report, out / PLOT_FILE)
    return report


def plot_scores(report: dict, png_path: Path) -> None:
    """Each candidate's score as a stacked bar (KL gain, recall gain), the chosen layers outlined."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    candidates = report["candidates"]
    layers = [c["layer"] for c in candidates]
    kl = [c["kl_gain"] for c in candidates]
    recall = [c["recall_gain"] for c in candidates]
    figure = Figure(figsize=(max(6, 0.3 * len(layers) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    chosen = set(report["chosen"])
    edges = ["black" if i in chosen else "none" for i in layers]
    axes.bar(layers, kl, color="tab:blue", edgecolor=edges, linewidth=1.2, label="KL gain: share of the student's KL removed")
    axes.bar(layers, recall, bottom=[max(k, 0) if r >= 0 else min(k, 0) for k, r in zip(kl, recall)], color="tab:orange",
             edgecolor=edges, linewidth=1.2, label="recall gain: share of the recall gap to the teacher closed")  # fmt: skip
    axes.scatter(layers, [c["score"] for c in candidates], color="black", marker="_", s=120, zorder=3, label="score (the sum)")
    axes.axhline(0, color="grey", lw=0.6)
    axes.set(xlabel="layer restored to attention (outlined: chosen)", ylabel="score",
             title=f"Graft layer selection: {len(chosen)} of {len(layers)} candidates kept as attention")  # fmt: skip
    axes.set_xticks(layers)
    axes.tick_params(axis="x", labelsize=7)
    axes.legend(fontsize=7)
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(png_path, dpi=120)
