"""The `context_scaling` section of `clover bench`: the cost of one decoding forward after a context
of random tokens, Clover's block forward against the peer's token forward (the fields are documented
in bench/run.py). The memory-only model is a random-init model of the memory-only preset unless
`--memory-model` names a trained one: a forward on random ids costs the same whatever the weights."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

from cloverlm.bench.options import BenchModels, BenchOptions, ratio
from cloverlm.model.cache import CloverCache
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.config import ATTENTION, preset_config
from cloverlm.model.layout import fixed_partition
from cloverlm.tokenizer import SPECIAL_TOKENS

# Clover's parallel prefill builds a context x context attention mask (and scores) in its attention
# layers: past this many tokens the rest of a long context is committed block by block instead.
PREFILL_LIMIT = 8192
PEER_PIECE = 2048  # the peer reads a long context in forwards of this many tokens
MEMORY_PRESET = "clover-tiny-memory"
MEMORY_SEED = 0


def random_memory_model(dtype: torch.dtype = torch.float32) -> CloverForBlockDiffusion:
    """A random-init model of MEMORY_PRESET (its vocabulary: the from-scratch tokenizer's 8,192), the same
    weights on every call; the global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MEMORY_SEED)
        model = CloverForBlockDiffusion(preset_config(MEMORY_PRESET))
    return model.to(dtype).eval()


def _random_ids(vocab_size: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """[1, count] ordinary tokens (no special ones: a [MASK] must not be committed)."""
    return torch.randint(len(SPECIAL_TOKENS), vocab_size, (1, count), generator=generator)


def _median_ms(forward: Callable[[], object], count: int) -> float:
    forward()  # warm-up; for Clover's fused forward also the one-time growth of the attention cache
    times = []
    for _ in range(count):
        started = time.perf_counter()
        forward()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


@torch.no_grad()
def _filled_cache(model: CloverForBlockDiffusion, context: int) -> CloverCache:
    """A one-row cache holding `context` committed random tokens."""
    config = model.config
    ids = _random_ids(config.vocab_size, context, torch.Generator().manual_seed(context))
    parallel = min(context, PREFILL_LIMIT) if ATTENTION in config.layer_types else context
    size = config.max_block_size
    blocks = fixed_partition(parallel, size)
    cache = CloverCache.empty(config, 1)
    model.prefill(ids[:, :parallel], blocks, cache)
    for start in tqdm(range(parallel, context, size), desc=f"commit {context} tokens", leave=False, disable=parallel == context):
        model.decode(cache, commit_ids=ids[:, start : start + size])
    return cache


@torch.no_grad()
def _clover_block_ms(model: CloverForBlockDiffusion, context: int, block_size: int, forwards_per_block: float, count: int) -> float:
    cache = _filled_cache(model, context)
    masked = torch.full((1, block_size), model.config.mask_token_id)
    clean = _random_ids(model.config.vocab_size, block_size, torch.Generator().manual_seed(0))
    step_ms = _median_ms(lambda: model.decode(cache, step_ids=masked), count)
    fused_ms = _median_ms(lambda: model.decode(cache, commit_ids=clean, step_ids=masked), count)
    return (fused_ms + (forwards_per_block - 1) * step_ms) / forwards_per_block


@torch.no_grad()
def _peer_token_ms(peer: Qwen3_5MoeForCausalLM, context: int, count: int) -> float:
    ids = _random_ids(peer.config.vocab_size, context, torch.Generator().manual_seed(context))
    cache = DynamicCache(config=peer.config)
    for start in range(0, context, PEER_PIECE):
        peer(ids[:, start : start + PEER_PIECE], cache=cache, use_cache=True, logits_to_keep=1)
    token = ids[:, -1:]
    return _median_ms(lambda: peer(token, cache=cache, use_cache=True), count)


def bench_context(models: BenchModels, options: BenchOptions, tpf: float) -> list[dict]:
    """One row per context; the fields are defined in the docstring of bench/run.py."""
    forwards_per_block = max(options.block_size / tpf, 1.0)
    block_tokens = round(tpf, 3)
    memory_only = models.memory_only
    if memory_only is None:
        memory_only = random_memory_model(next(models.clover.parameters()).dtype)
    rows = []
    for context in tqdm(options.contexts, desc="contexts"):
        clover_ms, memory_ms = (
            round(_clover_block_ms(model, context, options.block_size, forwards_per_block, options.timed_forwards), 3)
            for model in (models.clover, memory_only)
        )
        peer_ms = None if models.peer is None else round(_peer_token_ms(models.peer, context, options.timed_forwards), 3)
        rows.append(
            {
                "context": context,
                "clover_block_ms": clover_ms,
                "memory_only_block_ms": memory_ms,
                "block_tokens": block_tokens,
                "peer_token_ms": peer_ms,
                "speedup": ratio(None if peer_ms is None else peer_ms * block_tokens, clover_ms),
            }
        )
    return rows
