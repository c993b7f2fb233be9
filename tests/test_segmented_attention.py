"""The CPU trainer's attention takes only what the mask allows (NoisyBlocks.segments): the dense mask over
both streams stays the reference, and the two give the same loss and gradients (fp32, 1e-5) for several
examples per row, every block size, merged and separate segments, padded rows; the peer's loss computes
logits at the scored positions only and equals the loss over full logits."""

import pytest
import torch
import torch.nn.functional as F

from cloverlm.convert.adapter import with_adapter
from cloverlm.convert.base import convert_weights
from cloverlm.errors import CloverError
from cloverlm.training.conversion import objective
from cloverlm.training.conversion.frozen_base import frozen_linears_to, token_rows_apart
from cloverlm.training.conversion.objective import Segment, autoregressive_loss, build_batch, conversion_loss
from test_convert import MASK, tiny_llama

ROWS = [
    [Segment([1, 40, 41, 42, 43], [50, 51, 52, 53, 54, 2]), Segment([1, 60, 61], [70, 71, 2]),
     Segment([1, 33, 34, 35, 36, 37, 38, 39], list(range(10, 41)) + [2])],
    [Segment([1, 44, 45, 46, 47, 48, 49, 30, 31], [80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 2])],
    [Segment([1, 20, 21], [22, 23, 24, 25, 26], complete=False), Segment([1, 90], [91, 92, 2])],
]  # fmt: skip


def _batch(sizes, segmented, pad_multiple=1, rows=ROWS, draws=1):
    generator = torch.Generator().manual_seed(7)
    return build_batch(rows, end_id=2, mask_id=MASK, generator=generator, sizes=sizes, pad_multiple=pad_multiple,
                       segmented=segmented, draws=draws)  # fmt: skip


def _loss_and_grads(model, batch, loss_fn=conversion_loss):
    model.zero_grad(set_to_none=True)
    loss, stats = loss_fn(model, batch)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), grads, stats


@pytest.fixture(scope="module")
def model():
    return convert_weights(tiny_llama(5), MASK)


@pytest.mark.parametrize("sizes", [(1,), (2,), (4,), (8,), (16,), (32,), (4, 8, 16, 32)])
@pytest.mark.parametrize("pad_multiple", [1, 64])
@pytest.mark.parametrize("draws", [1, 2])
def test_segments_give_the_dense_masks_loss_and_gradients(model, sizes, pad_multiple, draws):
    dense = _batch(sizes, segmented=False, pad_multiple=pad_multiple, draws=draws)
    segmented = _batch(sizes, segmented=True, pad_multiple=pad_multiple, draws=draws)
    assert dense.noisy.segments is None and len(segmented.noisy.segments) == len(ROWS)
    assert segmented.targets.equal(dense.targets) and segmented.scored.equal(dense.scored)  # the same draws
    loss, grads, _ = _loss_and_grads(model, dense)
    fast_loss, fast_grads, _ = _loss_and_grads(model, segmented)
    assert abs(loss - fast_loss) < 1e-5
    assert (grads - fast_grads).abs().max() < 1e-5


def test_separate_segments_per_example_and_merged_ones_agree(model, monkeypatch):
    """Each example its own attention call, or all of a row's in one: the same loss and gradients."""
    results = {}
    for call_cost in (0, 10**9):
        monkeypatch.setattr(objective, "SEGMENT_CALL_COST", call_cost)
        batch = _batch((4, 8), segmented=True)
        results[call_cost] = (batch, *_loss_and_grads(model, batch))
    separate, merged = results[0][0].noisy.segments[0], results[10**9][0].noisy.segments[0]
    assert len(separate) == 3 and len(merged) == 1  # row 0 holds three examples
    assert [(s.start, s.end) for s in separate] == [(0, separate[0].end), (separate[0].end, separate[1].end),
                                                    (separate[1].end, merged[0].end)]  # fmt: skip
    assert abs(results[0][1] - results[10**9][1]) < 1e-5
    assert (results[0][2] - results[10**9][2]).abs().max() < 1e-5


def test_a_segment_attends_to_its_clean_prefix_and_its_own_blocks_only():
    batch = _batch((4,), segmented=True, rows=ROWS[1:2])
    (segment,) = batch.noisy.segments[0]
    history, block = batch.noisy.history[0, segment.start : segment.end], batch.noisy.block[0, segment.start : segment.end]
    assert segment.clean_keys == int(history.max()) and segment.mask.shape == (len(history), segment.clean_keys + len(history))
    for i in range(len(history)):
        assert segment.mask[i, : segment.clean_keys].sum() == history[i]
        assert segment.mask[i, segment.clean_keys :].equal(block == block[i])


def test_the_peers_loss_takes_logits_at_the_answer_only():
    base = tiny_llama(6)
    batch = _batch((4,), segmented=False)
    loss, grads, stats = _loss_and_grads(base, batch, autoregressive_loss)
    base.zero_grad(set_to_none=True)
    full = base(input_ids=batch.clean_ids).logits[batch.answer_mask]
    reference = F.cross_entropy(full, batch.answer_targets)
    reference.backward()
    reference_grads = torch.cat([p.grad.flatten() for p in base.parameters() if p.grad is not None])
    assert abs(loss - float(reference)) < 1e-6 and (grads - reference_grads).abs().max() < 1e-6
    assert stats["tokens"] == int(batch.clean_lengths.sum())


def test_frozen_base_in_bf16_gives_autocasts_loss_and_leaves_the_adapter_fp32():
    """The frozen weights stored in bf16 are the values autocast made on every forward: the same loss."""
    losses = []
    for store_bf16 in (False, True):
        model = with_adapter(convert_weights(tiny_llama(8), MASK), "diffusion", rank=4, alpha=8)
        if store_bf16:
            frozen_linears_to(model, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(float(conversion_loss(model, _batch((4,), segmented=True))[0]))
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.dtype == torch.float32 for p in trained)
    base_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert base_q.dtype == torch.bfloat16
    assert abs(losses[0] - losses[1]) < 1e-6


@pytest.mark.parametrize("objective_name", ["diffusion", "ar"])
def test_token_rows_apart_give_pefts_loss_and_gradients(objective_name):
    """The mask token's rows written over the frozen lookup and product (and the peer's head in its own
    copy): the loss and every trained gradient of peft's whole-matrix forward (fp32, 1e-5), and the mask
    token's row is among them. Under bf16 the head's copy holds autocast's values: the same loss."""
    results = {}
    for apart, dtype in ((False, None), (True, None), (False, torch.bfloat16), (True, torch.bfloat16)):
        base = tiny_llama(10)
        model = with_adapter(convert_weights(base, MASK) if objective_name == "diffusion" else base, objective_name,
                             rank=4, alpha=8)  # fmt: skip
        torch.manual_seed(0)
        for p in model.parameters():  # peft starts lora_B and the rows at no change: move them
            if p.requires_grad:
                p.data += 0.05 * torch.randn_like(p)
        if apart:
            token_rows_apart(model, dtype or torch.float32)
            assert any("forward" in m.__dict__ for m in model.modules())
        loss_fn = conversion_loss if objective_name == "diffusion" else autoregressive_loss
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            results[apart, dtype] = _loss_and_grads(model, _batch((4, 8), segmented=True), loss_fn)
        rows = [p for n, p in model.named_parameters() if "trainable_tokens_delta" in n]
        assert objective_name == "ar" or (rows and rows[0].grad.abs().sum() > 0)
    (loss, grads, _), (apart_loss, apart_grads, _) = results[False, None], results[True, None]
    assert abs(loss - apart_loss) < 1e-5 and (grads - apart_grads).abs().max() < 1e-5
    assert abs(results[False, torch.bfloat16][0] - results[True, torch.bfloat16][0]) < 1e-2


@pytest.mark.parametrize("objective_name", ["diffusion", "ar"])
def test_rows_apart_add_up_to_the_batchs_loss_and_gradients(objective_name):
    """The CPU trainer's micro-batches: each row cut to its real length, averaged over the whole batch's
    counts; their losses and accumulated gradients are the padded batch's (fp32, 1e-5)."""
    base = tiny_llama(9)
    model = convert_weights(base, MASK) if objective_name == "diffusion" else base
    loss_fn = conversion_loss if objective_name == "diffusion" else autoregressive_loss
    batch = _batch((4, 8, 16), segmented=True, pad_multiple=64)
    loss, grads, stats = _loss_and_grads(model, batch, loss_fn)
    model.zero_grad(set_to_none=True)
    parts = batch.rows_apart()
    assert [part.clean_ids.shape[1] for part in parts] == batch.clean_lengths.tolist()  # no padding left
    total, merged = 0.0, {}
    for part in parts:
        part_loss, part_stats = loss_fn(model, part)
        part_loss.backward()
        total += float(part_loss.detach())
        merged = {k: merged.get(k, 0) + v for k, v in part_stats.items()}
    part_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert abs(total - loss) < 1e-5 and (part_grads - grads).abs().max() < 1e-5
    assert all(abs(merged[k] - stats[k]) < 1e-5 for k in stats)


def test_certainty_forcing_refuses_a_row_apart(model):
    with pytest.raises(CloverError, match="do not split it into rows"):
        conversion_loss(model, _batch((4,), segmented=True).rows_apart()[0], certainty_weight=0.5)
