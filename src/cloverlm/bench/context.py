"""The `context_scaling` section of `clover bench`: the cost of one decoding forward after a context
of random tokens, Clover's block forward against the peer's token forward, beside it the same block
forward of the memory-only model and of a grafted hybrid (`--hybrid`), and each model's cache bytes
per request (the fields are documented in bench/run.py). The memory-only model is a random-init model
of the memory-only preset unless `--memory-model` names a trained one: a forward on random ids costs
the same whatever the weights."""

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
from cloverlm.model.config import ATTENTION, MEMORY, preset_config
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


def _medians_ms(forwards: list[Callable[[], object]], count: int) -> list[float]:
    """Each forward's median ms over `count` timed calls, the forwards taking turns call by call, so
    drift in the machine's speed hits them alike."""
    for forward in forwards:
        forward()  # warm-up; for Clover's fused forward also the one-time growth of the attention cache
    times: list[list[float]] = [[] for _ in forwards]
    for _ in range(count):
        for forward, taken in zip(forwards, times, strict=True):
            started = time.perf_counter()
            forward()
            taken.append(time.perf_counter() - started)
    return [1000 * statistics.median(taken) for taken in times]


def cache_bytes(cache: CloverCache) -> int:
    """The bytes of history a CloverCache holds: memory layers' recurrent state and conv tail (constant in
    the context), attention layers' keys and values at the filled positions (growing with it; a buffer's
    spare capacity is not counted)."""
    return cache.nbytes(MEMORY) + cache.nbytes(ATTENTION)


def peer_cache_bytes(cache: DynamicCache) -> int:
    """The bytes of history a transformers cache holds: keys and values of attention layers, conv and
    recurrent states of linear-attention ones (its keys grow by concatenation: no spare capacity)."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            held = getattr(layer, name, None)
            tensors = held.values() if isinstance(held, dict) else held if isinstance(held, list | tuple) else [held]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


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
def _clover_block_ms(
    models: list[CloverForBlockDiffusion], context: int, block_size: int, forwards_per_block: float, count: int
) -> list[tuple[float, int]]:
    """Per model: (ms per block forward in the engine's mix, cache bytes after the context). The models'
    step forwards take turns, then their fused forwards; models of one vocabulary read the same ids."""
    caches = [_filled_cache(model, context) for model in models]
    sizes = [cache_bytes(cache) for cache in caches]  # before timing: fused forwards commit more blocks
    step_forwards, fused_forwards = [], []
    for model, cache in zip(models, caches, strict=True):
        masked = torch.full((1, block_size), model.config.mask_token_id)
        clean = _random_ids(model.config.vocab_size, block_size, torch.Generator().manual_seed(0))
        step_forwards.append(lambda model=model, cache=cache, masked=masked: model.decode(cache, step_ids=masked))
        fused_forwards.append(
            lambda model=model, cache=cache, masked=masked, clean=clean: model.decode(cache, commit_ids=clean, step_ids=masked)
        )
    step_ms, fused_ms = _medians_ms(step_forwards, count), _medians_ms(fused_forwards, count)
    return [
        ((fused + (forwards_per_block - 1) * step) / forwards_per_block, size)
        for fused, step, size in zip(fused_ms, step_ms, sizes, strict=True)
    ]


@torch.no_grad()
def _peer_token_ms(peer: Qwen3_5MoeForCausalLM, context: int, count: int) -> tuple[float, int]:
    """(ms of one cached one-token forward, cache bytes after the context)."""
    ids = _random_ids(peer.config.vocab_size, context, torch.Generator().manual_seed(context))
    cache = DynamicCache(config=peer.config)
    for start in range(0, context, PEER_PIECE):
        peer(ids[:, start : start + PEER_PIECE], cache=cache, use_cache=True, logits_to_keep=1)
    size = peer_cache_bytes(cache)  # before timing: every timed forward appends its token
    token = ids[:, -1:]
    (ms,) = _medians_ms([lambda: peer(token, cache=cache, use_cache=True)], count)
    return ms, size


def bench_context(models: BenchModels, options: BenchOptions, tpf: float) -> list[dict]:
    """One row per context; the fields are defined in the docstring of bench/run.py."""
    forwards_per_block = max(options.block_size / tpf, 1.0)
    block_tokens = round(tpf, 3)
    memory_only = models.memory_only
    if memory_only is None:
        memory_only = random_memory_model(next(models.clover.parameters()).dtype)
    timed = [models.clover, memory_only] + ([] if models.hybrid is None else [models.hybrid])
    rows = []
    for context in tqdm(options.contexts, desc="contexts"):
        measured = _clover_block_ms(timed, context, options.block_size, forwards_per_block, options.timed_forwards)
        (clover_ms, clover_bytes), (memory_ms, memory_bytes), *hybrid = [(round(ms, 3), size) for ms, size in measured]
        hybrid_ms, hybrid_bytes = hybrid[0] if hybrid else (None, None)
        peer_ms = peer_bytes = None
        if models.peer is not None:
            peer_ms, peer_bytes = _peer_token_ms(models.peer, context, options.timed_forwards)
            peer_ms = round(peer_ms, 3)
        rows.append(
            {
                "context": context,
                "clover_block_ms": clover_ms,
                "memory_only_block_ms": memory_ms,
                "hybrid_block_ms": hybrid_ms,
                "hybrid_vs_clover": ratio(hybrid_ms, clover_ms),
                "block_tokens": block_tokens,
                "peer_token_ms": peer_ms,
                "speedup": ratio(None if peer_ms is None else peer_ms * block_tokens, clover_ms),
                "clover_cache_bytes": clover_bytes,
                "memory_only_cache_bytes": memory_bytes,
                "hybrid_cache_bytes": hybrid_bytes,
                "peer_cache_bytes": peer_bytes,
            }
        )
    return rows
