"""What the `clover bench` sections share: the options, the loaded models, the runners the tasks
section times (and the report plots and scripts/bench_table.py label), and the scoring and request
building of one held-out prompt. The sections import this module, never each other or bench/run.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

from cloverlm import tasks
from cloverlm.bench.llama_cpp import load_llama_cpp
from cloverlm.convert.load import has_tokenizer, load_folder_tokenizer, load_model
from cloverlm.convert.peer import PEER_ARCH, is_peer_folder, load_peer
from cloverlm.decoding.calibration import Calibration, load_calibration
from cloverlm.decoding.grounding import DEFAULT_ANSWERS, schema_for
from cloverlm.decoding.params import DecodeParams
from cloverlm.errors import CloverError
from cloverlm.evaluation.heldout import TokenizedExample, answer_budget
from cloverlm.model.checkpoint import inference_dtype
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.tokenizer import stop_token_ids

TASK_NAMES = tasks.SUITE
# The checker field a task is scored by; "exact" unless named here. A no_fly_zones answer lists many
# zones: the share of zones exactly right separates models that an all-or-nothing "exact" does not.
ACCURACY_FIELDS = {"no_fly_zones": "zone_exact_match", "no_fly_zones_unseen": "zone_exact_match"}
# Who the tasks section times, with their plot labels: Clover at the bench's block size, (d) Clover at
# block size 1, (a) the AR peer with transformers' generate, (b) the same with prompt lookup, (c)
# llama.cpp on the base's GGUF.
RUNNER_LABELS = {
    "clover": "Clover", "clover_b1": "Clover, block size 1", "peer": "peer: generate",
    "peer_lookup": "peer: generate + prompt lookup", "llama_cpp": "llama.cpp (base GGUF)",
}
RUNNERS = tuple(RUNNER_LABELS)
# The report's sections, in the order they run (bench/run.py documents each).
SECTIONS = ("tasks", "context_scaling", "schema", "block_sizes", "thresholds", "structured", "serving", "decisions")


@dataclass
class BenchOptions:
    tasks: tuple[str, ...] = TASK_NAMES
    prompts: int = 49  # held-out prompts, spread over the tasks
    repeats: int = 3  # timed runs of each request (medians reported)
    block_size: int = DecodeParams.block_size
    threshold: float = DecodeParams.threshold
    draft: bool = False  # Clover fills blocks with prompt-lookup drafts (all-attention models)
    answers: str = DEFAULT_ANSWERS  # how the tasks section decodes answers (decoding.grounding.ANSWER_MODES)
    sections: tuple[str, ...] = SECTIONS
    peer_lookup: int = 10  # peer (b): transformers' prompt_lookup_num_tokens
    contexts: tuple[int, ...] = (1024, 4096, 16384, 65536)
    timed_forwards: int = 10  # per context-scaling measurement (median reported)
    sweep_task: str = "no_fly_zones"
    sweep_prompts: int = 4
    sweep_block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)
    sweep_thresholds: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9, 0.95)
    schema_prompts: int = 20  # no_fly_zones prompts decoded free and under the answer's schema
    schema_messages: int = 20
    structured_prompts: int = 8  # tool_call prompts decoded free and under the grammar
    load_clients: int = 32  # the serving load test: concurrent clients x requests each
    load_requests: int = 10
    decision_prompts: int = 8  # drone_slots puzzles answered jointly and one at a time

    @classmethod
    def quick(cls, **overrides) -> BenchOptions:
        """A run of under 3 minutes on a 2-core CPU: one prompt per task, one repeat, short contexts."""
        fast = dict(prompts=4, repeats=1, contexts=(1024, 4096), timed_forwards=5, sweep_prompts=1, sweep_block_sizes=(4, 16, 64),
                    sweep_thresholds=(0.5, 0.9),
                    schema_prompts=1, schema_messages=4, structured_prompts=2, load_clients=4, load_requests=2, decision_prompts=2)
        return cls(**{**fast, **overrides})

    def validate(self) -> None:
        schema_for(None, self.answers)  # the mode's own error for a bad one
        unknown = [name for name in self.sections if name not in SECTIONS]
        if unknown or not self.sections:
            raise CloverError(f"unknown bench sections {unknown or '(none given)'}: choose from {', '.join(SECTIONS)}")
        if "context_scaling" in self.sections and "tasks" not in self.sections:
            raise CloverError("the context_scaling section needs the tasks section: it reads Clover's TPF from there")
        if self.prompts < len(self.tasks):
            raise CloverError(f"{self.prompts} prompts cannot cover {len(self.tasks)} tasks: give at least one per task")
        for name in ("repeats", "timed_forwards", "sweep_prompts", "schema_prompts", "schema_messages"):
            if getattr(self, name) < 1:
                raise CloverError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.contexts or min(self.contexts) < 1:
            raise CloverError(f"contexts must be positive token counts, got {list(self.contexts)}")


@dataclass
class BenchModels:
    clover: CloverForBlockDiffusion
    memory_only: CloverForBlockDiffusion | None  # None: context scaling builds a random-init one (bench/context.py)
    peer: Qwen3_5MoeForCausalLM | None
    tokenizer: PreTrainedTokenizerFast  # Clover's; the peer must share it (same prompts, same ids)
    folders: dict[str, str | None]  # where each model came from, for the report
    calibration: Calibration | None = None  # Clover's block-size head: adds "auto" to the block-size sweep
    llama: object | None = None  # a llama_cpp.Llama on the base's GGUF (cloverlm.bench.llama_cpp), or None
    hybrid: CloverForBlockDiffusion | None = None  # a grafted hybrid (`--hybrid`): context scaling times it beside Clover


def parse_context(text: str) -> int:
    """A context length: "4096", or with a k suffix, "4k" = 4096."""
    digits, kilo = (text[:-1], 1024) if text.lower().endswith("k") else (text, 1)
    if not digits.isdigit() or int(digits) < 1:
        raise CloverError(f"a context is a positive token count like 4096 or 4k, got '{text}'")
    return int(digits) * kilo


def load_models(
    clover_dir: Path, memory_dir: Path | None, peer_dir: Path | None, llama_gguf: Path | None = None, hybrid_dir: Path | None = None
) -> BenchModels:
    """Load the models (no peer when peer_dir is None, no llama.cpp without a GGUF, no hybrid without
    hybrid_dir), in the dtype this machine decodes fastest in; the peer is checked first, it is the one
    most likely missing. The hybrid must share Clover's vocabulary: both read the same context ids."""
    if peer_dir is not None and not is_peer_folder(peer_dir):
        raise CloverError(
            f"no peer model at {peer_dir}: train one with `clover train --recipe convert --arch ar --out runs/convert-peer` "
            f"(a converted base; `clover train --arch {PEER_ARCH}` for a from-scratch Clover) and pass --peer, or run with --no-peer"
        )
    tokenizer = load_folder_tokenizer(clover_dir)
    dtype = inference_dtype()
    peer = None
    if peer_dir is not None:
        peer = load_peer(peer_dir, dtype)
        if has_tokenizer(peer_dir) and load_folder_tokenizer(peer_dir).get_vocab() != tokenizer.get_vocab():
            raise CloverError(f"the peer at {peer_dir} uses another tokenizer than {clover_dir}: the prompts would differ")
    clover = load_model(clover_dir, dtype)
    hybrid = None if hybrid_dir is None else load_model(hybrid_dir, dtype)
    if hybrid is not None and hybrid.config.vocab_size != clover.config.vocab_size:
        raise CloverError(
            f"the hybrid at {hybrid_dir} has a vocabulary of {hybrid.config.vocab_size} tokens, {clover_dir} one of "
            f"{clover.config.vocab_size}: the two must read the same contexts (graft it from this model: clover convert --graft memory)"
        )
    return BenchModels(
        clover=clover,
        memory_only=None if memory_dir is None else load_model(memory_dir, dtype),
        peer=peer,
        tokenizer=tokenizer,
        calibration=load_calibration(clover_dir),
        folders={"clover": str(clover_dir), "memory_only": None if memory_dir is None else str(memory_dir), "peer": None if peer_dir is None else str(peer_dir),
                 "llama_cpp": None if llama_gguf is None else str(llama_gguf), "hybrid": None if hybrid_dir is None else str(hybrid_dir)},
        llama=None if llama_gguf is None else load_llama_cpp(llama_gguf, torch.get_num_threads()),
        hybrid=hybrid,
    )


# ----------------------------------------------------------------------------------------------
# One held-out prompt: its prompt ids, Clover's decoding parameters for it, its score


def prompt_ids(example: TokenizedExample) -> list[int]:
    return example.ids[: example.prompt_length]


def clover_params(example: TokenizedExample, options: BenchOptions, tokenizer, block_size: int | str) -> DecodeParams:
    return DecodeParams(
        max_new_tokens=answer_budget(example),
        block_size=block_size,
        threshold=options.threshold,
        draft=options.draft,
        stop_token_ids=stop_token_ids(tokenizer),
    )


def accuracy(task: str, example: TokenizedExample, tokens: list[int], tokenizer) -> float:
    scores = tasks.get_task(task).check(example.example, tokenizer.decode(tokens))
    return scores[ACCURACY_FIELDS.get(task, "exact")]


def ratio(numerator: float | None, denominator: float) -> float | None:
    """A speedup field: numerator / denominator, or None when the numerator's runner did not run (or the
    denominator is 0: a score that found nothing)."""
    return None if numerator is None or not denominator else round(numerator / denominator, 3)
