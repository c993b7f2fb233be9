"""`clover bench`: Clover against its autoregressive peer, in one process, on the same prompts.

Each section is one function and one key of the JSON report, in its own module of cloverlm.bench
(what they share, the options and the models, is in `cloverlm.bench.options`):

* `tasks` and `median_exec_s` (bench_tasks, `cloverlm.bench.tasks`): held-out prompts spread over
  the tasks (49 by default, the 49-task view), decoded one request at a time (batch 1: latency),
  each answer under its schema (the task's answer_schema, grounded unless `answers` says "schema", or
  the offered tools' call grammar; the peer with jump-forward, peer_lookup only on prompts without
  one), or free where `answers` is "free".
  After a warm-up request per model, Clover and the peer alternate request by request, so drift in
  the machine's speed hits both alike; every request runs `repeats` times and its wall time is the
  median of its runs. Per task: accuracy by the task's checker (the mean of its "exact" field;
  "zone_exact_match" for no_fly_zones), the median wall time per request, tokens/s (generated tokens
  / wall seconds, summed over the task's requests) and Clover's tokens per forward (TPF).
  speedup = peer wall_s_median / Clover wall_s_median.
  median_exec_s: each model's median wall time over all requests.
* `context_scaling` (bench_context, `cloverlm.bench.context`): the cost of one decoding forward
  after a context of random tokens, and what a request's cache holds there. Clover's forwards are
  block forwards; a block of B tokens takes B / TPF of them (TPF as measured in the tasks section):
  the first commits the previous block fused with a denoising step, the others only denoise. So
    - clover_block_ms = (fused_ms + (B / TPF - 1) * step_ms) / (B / TPF): one block forward in the
      engine's mix, median over timed forwards; memory_only_block_ms: the same for the memory-only
      model; hybrid_block_ms: the same for the grafted hybrid of `--hybrid` (null without it). All
      three use Clover's B and TPF, so they compare the architectures' cost per forward; Clover and
      the hybrid read the same context ids, and the models' timed forwards take turns call by call;
    - hybrid_vs_clover = hybrid_block_ms / clover_block_ms (issue 30's target: <= 0.5 at 8k);
    - block_tokens = TPF: the tokens one Clover block forward yields;
    - peer_token_ms: one cached one-token forward of the peer;
    - speedup = peer_token_ms * block_tokens / clover_block_ms: the peer's time to produce the tokens
      one Clover block forward yields, over the time of that forward;
    - clover_cache_bytes, memory_only_cache_bytes, hybrid_cache_bytes, peer_cache_bytes: the bytes
      of history the model's one-row cache holds after the context (null for a model not run):
      attention layers' keys and values at the filled positions, growing linearly with the context
      (spare capacity not counted: a prefill's buffers hold exactly the context, but blocks committed
      after it, here those past 8,192 tokens, double a full buffer, and the engine reserves the
      answer budget after a prefill; the peer's grow by concatenation and hold exactly this); memory
      layers' recurrent state and conv tail (the peer's linear-attention layers': conv and recurrent
      states), the same at every context.
  Cache bytes are taken before timing: timed fused forwards each commit one more block, so the
  context grows by a few blocks while timing.
* `schema` (bench_schema, `cloverlm.bench.schema`): no-fly-zone extraction as JSON, Clover free and
  under the answer's schema and the peer under the schema: parsed, schema-valid, zone exact, TPF, the
  forced-token share, the cost of a constrained forward against a free one, and the speedup.
* `block_sizes` (bench_block_sizes, `cloverlm.bench.sweeps`): Clover's TPF and accuracy at fixed
  block sizes on one task, and at block_size "auto" when the Clover folder holds a calibration
  (`clover calibrate`); `thresholds` (bench_thresholds): the same at the bench's block size per
  confidence threshold.
* `structured` and `serving` (`cloverlm.bench.serving`): TPF with a tool-call grammar next to TPF
  without; the load test (concurrent clients against `clover serve` on loopback, against one client).
* `decisions` (`cloverlm.bench.decisions`): drone_slots puzzles answered one at a time, jointly,
  and jointly with distinct answers: the rate of mutually consistent answer sets, and wall time.

write_report (`cloverlm.bench.report`) writes the JSON and, next to it, `<stem>_tasks.png`,
`<stem>_context.png`, `<stem>_block_sizes.png` and `<stem>_thresholds.png`. Without a peer its
fields are null and its plot series are left out.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform

import torch
import transformers

from cloverlm.bench.context import bench_context
from cloverlm.bench.decisions import bench_decisions
from cloverlm.bench.options import BenchModels, BenchOptions
from cloverlm.bench.schema import bench_schema
from cloverlm.bench.serving import bench_load, bench_structured
from cloverlm.bench.sweeps import bench_block_sizes, bench_thresholds
from cloverlm.bench.tasks import bench_tasks


def run_bench(models: BenchModels, options: BenchOptions) -> dict:
    """The sections in options.sections (all by default), in the JSON shape documented above, plus "meta";
    a section not run is absent from the report."""
    options.validate()
    clover, tokenizer, block_size, threshold = models.clover, models.tokenizer, options.block_size, options.threshold
    report: dict = {}
    if "tasks" in options.sections:
        report["tasks"], report["median_exec_s"], tpf = bench_tasks(models, options)
    sections = {
        "context_scaling": lambda: bench_context(models, options, tpf),
        "schema": lambda: bench_schema(models, options),
        "block_sizes": lambda: bench_block_sizes(models, options),
        "thresholds": lambda: bench_thresholds(models, options),
        "structured": lambda: bench_structured(clover, tokenizer, options.structured_prompts, block_size, threshold),
        "serving": lambda: bench_load(clover, tokenizer, options.load_clients, options.load_requests, block_size=block_size, threshold=threshold),
        "decisions": lambda: bench_decisions(clover, tokenizer, options.decision_prompts, threshold=threshold),
    }
    for name, section in sections.items():
        if name in options.sections:
            report[name] = section()
    return {
        **report,
        "meta": {
            "models": models.folders,
            "torch_threads": torch.get_num_threads(),
            "dtype": str(next(models.clover.parameters()).dtype).removeprefix("torch."),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            # lists, not tuples: the report reads back from its JSON unchanged
            **{key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(options).items()},
        },
    }
