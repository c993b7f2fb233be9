"""The decoding engine: invariants 3 (fused commit + step), 4 (batched == alone), 5 (block size 1 ==
greedy next-token decoding), the constant-size memory cache, stops, streaming, joining a running
batch, and clear errors for bad input."""

import pytest
import torch

from cloverlm import CloverCache, CloverError
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.model.config import ATTENTION, MEMORY
from conftest import tiny_model

MASK = 2


def prompt(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (length,), generator=g).tolist()


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-memory"])
def test_fused_commit_and_step_equals_commit_then_step(preset):
    """Invariant 3, for a batch whose rows commit blocks of different sizes (one row commits nothing)
    and then denoise blocks of different sizes against caches of different lengths."""
    model = tiny_model(preset)
    lengths = [24, 9, 16]
    commit_sizes, step_sizes = [5, 0, 8], [4, 7, 2]

    def fresh():
        caches = []
        for i, length in enumerate(lengths):
            cache = CloverCache.empty(model.config)
            model.prefill(torch.tensor([prompt(length, i)]), [length], cache)
            caches.append(cache)
        return CloverCache.concat(caches)

    def blocks(sizes, seed, fill=None):
        ids = torch.full((3, max(sizes)), MASK)
        valid = torch.zeros(3, max(sizes), dtype=torch.bool)
        for row, size in enumerate(sizes):
            ids[row, :size] = torch.tensor(prompt(size, seed + row)) if fill is None else fill
            valid[row, :size] = True
        return ids, valid

    commit_ids, commit_valid = blocks(commit_sizes, 10)
    step_ids, step_valid = blocks(step_sizes, 20)
    step_ids[0, 1] = step_ids[1, 3] = MASK
    with torch.no_grad():
        fused_cache = fresh()
        fused = model.decode(fused_cache, commit_ids, commit_valid, step_ids, step_valid).logits
        separate_cache = fresh()
        model.decode(separate_cache, commit_ids=commit_ids, commit_valid=commit_valid)
        separate = model.decode(separate_cache, step_ids=step_ids, step_valid=step_valid).logits
    assert fused_cache.lengths.tolist() == separate_cache.lengths.tolist() == [29, 9, 24]
    torch.testing.assert_close(fused[step_valid], separate[step_valid], atol=1e-5, rtol=1e-5)


def test_batched_rows_equal_each_row_alone():
    """A padded batch gives each row the logits it gets alone (the model-level half of invariant 4)."""
    model = tiny_model()
    lengths, sizes = [30, 7], [3, 6]
    with torch.no_grad():
        alone = []
        caches = []
        for i, (length, size) in enumerate(zip(lengths, sizes)):
            cache = CloverCache.empty(model.config)
            model.prefill(torch.tensor([prompt(length, i)]), [length], cache)
            caches.append(cache)
            single = CloverCache.concat([cache])
            alone.append(model.decode(single, step_ids=torch.tensor([prompt(size, 5 + i)])).logits[0])
        ids = torch.full((2, 6), MASK)
        valid = torch.zeros(2, 6, dtype=torch.bool)
        for i, size in enumerate(sizes):
            ids[i, :size] = torch.tensor(prompt(size, 5 + i))
            valid[i, :size] = True
        batched = model.decode(CloverCache.concat(caches), step_ids=ids, step_valid=valid).logits
    for i, size in enumerate(sizes):
        torch.testing.assert_close(batched[i, :size], alone[i], atol=1e-5, rtol=1e-5)


def greedy_next_token(model, ids, count):
    """Reference decoder: next-token argmax through the parallel training forward (block size 1; under
    the shifted convention the last position predicts the next token)."""
    seq = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(count):
            clean = torch.tensor([seq])
            logits = model(clean, clean, [1] * len(seq)).logits[0, -1]
            logits[MASK] = float("-inf")
            token = int(logits.argmax())
            if token == model.config.eos_token_id:
                break
            out.append(token)
            seq.append(token)
    return out


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-memory"])
def test_block_size_one_is_greedy_next_token_decoding(preset):
    """Invariant 5."""
    model = tiny_model(preset)
    ids = prompt(13)
    [completion] = Engine(model).generate([Request(ids, DecodeParams(max_new_tokens=12, block_size=1))])
    assert completion.tokens == greedy_next_token(model, ids, 12)
    assert completion.steps == completion.forwards == len(completion.tokens)


def test_batch_decodes_as_each_request_alone():
    """Invariant 4: different prompt lengths, block sizes, thresholds and strategies in one batch."""
    model = tiny_model()
    requests = [
        (prompt(21, 1), DecodeParams(max_new_tokens=20, block_size=8, threshold=0.3)),
        (prompt(5, 2), DecodeParams(max_new_tokens=17, block_size=4, threshold=1.0)),
        (prompt(40, 3), DecodeParams(max_new_tokens=9, block_size=1)),
        (prompt(16, 4), DecodeParams(max_new_tokens=24, block_size=16, strategy="low_confidence", steps=4)),
        (prompt(11, 5), DecodeParams(max_new_tokens=12, block_size=6, temperature=0.8, top_p=0.9, seed=7)),
    ]
    alone = [Engine(model).generate([Request(ids, params)])[0].tokens for ids, params in requests]
    together = Engine(model).generate([Request(ids, params) for ids, params in requests])
    assert [c.tokens for c in together] == alone
    assert len(alone[0]) == 20 and len(alone[1]) == 17


def test_a_request_joining_a_running_batch_gets_the_same_tokens():
    model = tiny_model()
    late = (prompt(19, 9), DecodeParams(max_new_tokens=14, block_size=4, threshold=0.5))
    [expected] = Engine(model).generate([Request(*late)])
    engine = Engine(model)
    engine.submit(Request(prompt(33, 8), DecodeParams(max_new_tokens=30, block_size=8), request_id="early"))
    for _ in range(5):
        assert engine.step() == []
    engine.submit(Request(*late, request_id="late"))
    finished = {c.request_id: c for c in engine.run()}
    assert finished["late"].tokens == expected.tokens
    assert len(finished["early"].tokens) == 30


def test_threshold_one_unmasks_one_per_step_and_low_threshold_goes_parallel():
    model = tiny_model()
    ids = prompt(8)  # a whole block: generation starts on a fresh block
    [serial] = Engine(model).generate([Request(ids, DecodeParams(max_new_tokens=16, block_size=8, threshold=1.0))])
    assert serial.steps == 16 and serial.forwards == 16
    [parallel] = Engine(model).generate(
        [Request(ids, DecodeParams(max_new_tokens=16, block_size=8, threshold=1e-6))]
    )
    assert parallel.steps == 2 and parallel.tokens_per_forward == 8.0
    [capped] = Engine(model).generate([Request(ids, DecodeParams(max_new_tokens=16, block_size=8, threshold=1.0, max_steps=3))])
    assert capped.steps == 6


def test_low_confidence_uses_the_fixed_number_of_steps():
    model = tiny_model()
    params = DecodeParams(max_new_tokens=32, block_size=16, strategy="low_confidence", steps=5)
    [completion] = Engine(model).generate([Request(prompt(16), params)])
    assert completion.blocks == 2 and completion.steps == 10


def test_memory_cache_is_constant_and_attention_cache_grows_linearly():
    model = tiny_model()
    sizes = {}
    with torch.no_grad():
        for length in (100, 10_000):
            cache = CloverCache.empty(model.config)
            model.prefill(torch.tensor([prompt(length)]), [50] * (length // 50), cache)
            model.decode(cache, commit_ids=torch.tensor([prompt(16, 1)]))
            sizes[length] = (cache.nbytes(MEMORY), cache.nbytes(ATTENTION))
    assert sizes[100][0] == sizes[10_000][0] > 0
    assert sizes[10_000][1] / sizes[100][1] == pytest.approx(10_016 / 116)


def test_stop_token_and_stop_callable_cut_exactly():
    model = tiny_model()
    ids = prompt(12)
    [free] = Engine(model).generate([Request(ids, DecodeParams(max_new_tokens=24, block_size=4))])
    cut_at = 9
    stop_token = free.tokens[cut_at]
    first = free.tokens.index(stop_token)
    [stopped] = Engine(model).generate(
        [Request(ids, DecodeParams(max_new_tokens=24, block_size=4, stop_token_ids=(stop_token,)))]
    )
    assert stopped.tokens == free.tokens[:first] and stopped.finish_reason == "stop"
    seen = []

    def stop(tokens):
        seen.append(len(tokens))
        return 6 if len(tokens) >= 8 else None

    [callable_stop] = Engine(model).generate([Request(ids, DecodeParams(max_new_tokens=24, block_size=4, stop=stop))])
    assert callable_stop.tokens == free.tokens[:6] and callable_stop.finish_reason == "stop"
    assert seen == [4, 8]
    assert free.finish_reason == "length"


def test_streaming_callbacks():
    model = tiny_model()
    blocks, steps = [], []
    request = Request(
        prompt(10),
        DecodeParams(max_new_tokens=10, block_size=4, threshold=0.5),
        on_step=lambda r, block: steps.append(block),
        on_block=lambda r, tokens: blocks.append(tokens),
    )
    [completion] = Engine(model).generate([request])
    assert sum(blocks, []) == completion.tokens
    assert [len(b) for b in blocks] == [4, 4, 2]  # every block is fresh; the budget cuts the last one
    assert len(steps) == completion.steps and MASK not in steps[-1]


def test_sampling_is_seeded():
    model = tiny_model()
    params = dict(max_new_tokens=12, block_size=4, temperature=1.0, top_k=20)
    runs = [Engine(model).generate([Request(prompt(8), DecodeParams(**params, seed=s))])[0].tokens for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
        (dict(max_new_tokens=-3), "max_new_tokens must be at least 1"),
        (dict(threshold=0.0), "threshold must be in (0, 1]"),
        (dict(threshold=1.5), "threshold must be in (0, 1]"),
        (dict(block_size=65), "block size 65 is outside 1..64"),
        (dict(strategy="greedy"), "unknown strategy 'greedy'"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
    ],
)
def test_bad_parameters_get_a_clear_error(params, message):
    with pytest.raises(CloverError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        Engine(tiny_model()).submit(Request(prompt(4), DecodeParams(**params)))


def test_empty_batch_and_empty_prompt_get_a_clear_error():
    engine = Engine(tiny_model())
    with pytest.raises(CloverError, match="empty batch"):
        engine.generate([])
    with pytest.raises(CloverError, match="empty prompt"):
        engine.submit(Request([]))
    with pytest.raises(CloverError, match="the prompt contains the mask token id 2"):
        engine.submit(Request([5, MASK, 7]))


# -- every request ends: a bound on forwards (issue 22) --


def forward_bound(request: Request) -> int:
    """The most forwards the engine spends on a request. Every step unmasks at least one position (the
    most confident open one; under a grammar the first masked; under distinct slots one that keeps the
    rest assignable) and a block is done after its step cap: max_steps (threshold rule, no drafts: the
    last step fills every masked position), steps (low_confidence), else its length. The blocks are
    block_size long except the last, max_new_tokens in all, so the bound is the sum over the blocks of
    min(length, cap) <= max_new_tokens. A slot layout is one block: at most one forward per slot."""
    params = request.params
    if request.slots is not None:
        return len(request.slots.options)
    size, total = params.block_size, params.max_new_tokens
    sizes = [size] * (total // size) + ([total % size] if total % size else [])
    cap = params.steps if params.strategy == "low_confidence" else None if params.draft else params.max_steps
    return sum(min(length, cap or length) for length in sizes)


@pytest.fixture(scope="module")
def bound_models(tokenizer):
    from cloverlm.decoding.grammar import Grammars
    from cloverlm.tokenizer import stop_token_ids

    mixed = tiny_model(vocab_size=len(tokenizer))
    attention = tiny_model(vocab_size=len(tokenizer), layer_types=[ATTENTION] * 4, causal_clean_stream=True)
    stops = stop_token_ids(tokenizer)
    return mixed, attention, Grammars(tokenizer, len(tokenizer), stops), stops


def test_forwards_never_pass_the_stated_bound(bound_models):
    """Property: for any request (strategy, threshold, max_steps, steps, sampling, drafts, a grammar, slots
    with or without distinct answers), batched with others, completion.forwards <= forward_bound."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from cloverlm.decoding.params import Slots

    mixed, attention, grammars, stops = bound_models
    tokens = st.integers(20, 2000)

    @st.composite
    def requests(draw, drafts: bool):
        kind = draw(st.sampled_from(["plain", "grammar", "slots", "slots"]) if not drafts else st.just("plain"))
        strategy = "threshold" if drafts else draw(st.sampled_from(["threshold", "low_confidence"]))
        params = DecodeParams(
            max_new_tokens=draw(st.integers(1, 24)), block_size=draw(st.integers(1, 12)), strategy=strategy,
            threshold=draw(st.floats(0.01, 1.0)), max_steps=draw(st.none() | st.integers(1, 6)),
            steps=draw(st.none() | st.integers(1, 6)), temperature=draw(st.sampled_from([0.0, 1.0])),
            seed=draw(st.integers(0, 99)), draft=drafts, stop_token_ids=stops,
        )
        prompt_ids = draw(st.lists(tokens, min_size=1, max_size=20))
        if kind == "grammar":
            return Request(prompt_ids, params, constraint=grammars.constraint(grammars.json_object()))
        if kind == "slots":
            layout = draw(st.lists(st.none() | tokens, min_size=1, max_size=8))
            if None not in layout:
                layout[0] = None
            options = [draw(st.lists(st.integers(20, 25), min_size=1, max_size=4)) for _ in range(layout.count(None))]
            return Request(prompt_ids, params, slots=Slots(layout, options, distinct=draw(st.booleans())))
        return Request(prompt_ids, params)

    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        drafts = data.draw(st.booleans())
        batch = data.draw(st.lists(requests(drafts), min_size=1, max_size=3))
        engine = Engine(attention if drafts else mixed, max_batch_size=2)
        accepted = []
        for request in batch:
            try:
                engine.submit(request)
                accepted.append(request)
            except CloverError as error:  # only distinct slots with too few options are refused
                assert request.slots is not None and request.slots.distinct and "fewer options" in str(error)
        done = []
        for _ in range(sum(forward_bound(r) for r in accepted) + 1):  # the batch can take no more (a hang fails here)
            if not engine.has_work():
                break
            done += engine.step()
        assert not engine.has_work()
        for request, completion in zip(accepted, sorted(done, key=lambda c: c.order)):
            assert completion.forwards == completion.steps <= forward_bound(request), (request.params, request.slots)
            assert completion.finish_reason in ("stop", "length")

    check()
