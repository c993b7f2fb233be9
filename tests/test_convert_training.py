"""The conversion trainer's batches and steps: the default mixture builds, padded and packed rows give the
loss of the unpadded ones, certainty forcing, warm starts and the lineage an adapter records."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cloverlm.convert.base import convert_weights
from cloverlm.convert.load import load_folder_tokenizer
from cloverlm.errors import CloverError
from cloverlm.training.conversion.data import ConversionData, read_trajectories
from cloverlm.training.conversion.distill import summarize, trajectory_example
from cloverlm.training.conversion.objective import Segment, autoregressive_loss, build_batch, conversion_loss
from cloverlm.training.conversion.trainer import ConvertConfig, ConvertTrainer, adapter_lineage
from test_convert import MASK, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
BASE_TOKENIZER = ROOT / "models" / "smollm2-clover"


@pytest.fixture(scope="module")
def base_tokenizer():
    return load_folder_tokenizer(BASE_TOKENIZER)


def test_the_default_mixture_builds_a_step_batch_with_chat(base_tokenizer):
    """What `clover train --recipe convert` builds at its first steps, chat data included."""
    cfg = ConvertConfig(rows_per_step=2)
    data = ConversionData(base_tokenizer, cfg)
    assert len(data.chat) == cfg.chat_examples
    batch = data.step_batch(0)
    assert batch.clean_ids.shape[0] == 2 and batch.noisy.input_ids.shape[0] == 2
    assert batch.scored.any() and batch.answer_mask.any()
    counts = batch.token_counts()
    assert (
        counts["clean"] == int(batch.clean_lengths.sum()) and 0 < counts["noisy"] <= batch.noisy.block.numel()
    )
    chat_only = ConversionData(base_tokenizer, ConvertConfig(mixture={"chat": 1.0})).row_segments(3)
    prompts = {tuple(data.chat_segment(record).prompt) for record in data.chat}
    assert all(tuple(segment.prompt) in prompts for segment in chat_only)
    assert data.step_batch(5).clean_ids.equal(
        ConversionData(base_tokenizer, cfg).step_batch(5).clean_ids
    )  # pure in step


def test_unknown_sources_and_missing_trajectories_are_clear_errors(base_tokenizer, tmp_path):
    with pytest.raises(CloverError, match=r"unknown mixture sources \['poetry'\]"):
        ConversionData(base_tokenizer, ConvertConfig(mixture={"poetry": 1.0}))
    with pytest.raises(CloverError, match="no trajectories file"):
        ConversionData(base_tokenizer, ConvertConfig(mixture={"distill": 1.0}))
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"index": 0, "task": "arithmetic", "kept": False}) + "\n")
    with pytest.raises(CloverError, match="holds no right answer to distil \\(1 tried\\)"):
        read_trajectories(path)


SEGMENTS = [
    [Segment([1, 40, 41, 42, 43], [50, 51, 52, 53, 54, 2]), Segment([1, 60, 61], [70, 71, 2])],
    [Segment([1, 44, 45, 46, 47, 48, 49, 30, 31], [80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 2])],
]


def _batch(rows, pad_multiple):
    return build_batch(rows, end_id=2, mask_id=MASK, generator=torch.Generator().manual_seed(11), sizes=(4, 8),
                       pad_multiple=pad_multiple)  # fmt: skip


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("loss_fn", ["diffusion", "ar"])
def test_padded_packed_rows_give_the_loss_and_gradients_of_unpadded_rows(loss_fn):
    """Static shapes change nothing: a step padded to multiples of 64 gives the unpadded step's loss and
    gradients (fp32, 1e-5), and two packed rows give the losses of each row alone."""
    base = tiny_llama(3)
    model = convert_weights(base, MASK) if loss_fn == "diffusion" else base
    loss = conversion_loss if loss_fn == "diffusion" else autoregressive_loss
    results = []
    for pad in (1, 64):
        batch = _batch(SEGMENTS, pad)
        if pad > 1:
            assert batch.clean_ids.shape[1] % pad == 0 and batch.noisy.input_ids.shape[1] % pad == 0
        value, stats = loss(model, batch)
        value.backward()
        results.append((float(value.detach()), _grads(model), stats))
        model.zero_grad(set_to_none=True)
    (plain, plain_grad, plain_stats), (padded, padded_grad, padded_stats) = results
    assert abs(plain - padded) < 1e-5
    assert (plain_grad - padded_grad).abs().max() < 1e-5
    assert plain_stats["tokens"] == padded_stats["tokens"]  # padding is not counted as tokens seen
    # each row alone, with the masks the packed batch drew for it: the same per-slot predictions
    packed = _batch(SEGMENTS, 64)
    with torch.no_grad():
        if loss_fn == "diffusion":
            every = torch.ones_like(packed.scored)
            both = model(packed.clean_ids, noisy_blocks=packed.noisy, logits_mask=every).logits.view(
                2, -1, 97
            )
            for row in range(2):
                n, length = int((packed.noisy.block[row] >= 0).sum()), int(packed.clean_lengths[row])
                noisy = type(packed.noisy)(*(t[row : row + 1, :n] for t in (packed.noisy.input_ids, packed.noisy.positions,
                                                                              packed.noisy.block, packed.noisy.history)))  # fmt: skip
                alone = model(
                    packed.clean_ids[row : row + 1, :length],
                    noisy_blocks=noisy,
                    logits_mask=torch.ones(1, n, dtype=torch.bool),
                ).logits
                assert (alone - both[row, :n]).abs().max() < 1e-5
        else:
            both = model(input_ids=packed.clean_ids).logits
            for row in range(2):
                length = int(packed.clean_lengths[row])
                alone = model(input_ids=packed.clean_ids[row : row + 1, :length]).logits
                assert (alone[0] - both[row, :length]).abs().max() < 1e-5


def test_certainty_forcing_adds_the_entropy_of_right_predictions():
    model = convert_weights(tiny_llama(4), MASK)
    batch = _batch(SEGMENTS, 1)
    plain, _ = conversion_loss(model, batch)
    forced, stats = conversion_loss(model, batch, certainty_weight=0.5)
    out = model(batch.clean_ids, noisy_blocks=batch.noisy, logits_mask=batch.scored).logits
    right = out.argmax(-1) == batch.targets[batch.scored]
    log_probs = out[right].log_softmax(-1)
    entropy = float(-(log_probs.exp() * log_probs).sum(-1).mean()) if right.any() else 0.0
    assert abs(stats["certainty_entropy"] - entropy) < 1e-5
    assert abs(float(forced) - float(plain) - 0.5 * entropy) < 1e-5


def test_trajectory_prompts_are_a_pure_function_of_seed_and_index():
    mixture = {"no_fly_zones": 0.5, "arithmetic": 0.5, "chat": 1.0}
    first = [trajectory_example(i, mixture, 0, 0.3) for i in range(6)]
    assert [e.prompt for e in first] == [trajectory_example(i, mixture, 0, 0.3).prompt for i in range(6)]
    assert {e.task for e in first} <= {"no_fly_zones", "arithmetic"}  # chat is no task to check
    assert all(e.seed < 1_000_000_000 for e in first)  # never a held-out seed
    with pytest.raises(CloverError, match="names no task to distil"):
        trajectory_example(0, {"chat": 1.0}, 0, 0.3)
    records = [
        {"task": "arithmetic", "kept": True},
        {"task": "arithmetic", "kept": False},
        {"task": "tool_call", "kept": True},
    ]
    assert summarize(records) == {
        "tried": 3,
        "kept": 2,
        "by_task": {"arithmetic": {"tried": 2, "kept": 1}, "tool_call": {"tried": 1, "kept": 1}},
    }


def test_a_bad_device_or_init_adapter_is_a_clear_error(tmp_path):
    from cloverlm.training.conversion.trainer import resolve_device

    with pytest.raises(CloverError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(CloverError, match="no CUDA device"):
            resolve_device("cuda")
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(CloverError, match="not an adapter folder"):
        ConvertTrainer(
            ConvertConfig(mixture={"arithmetic": 1.0}, init_adapter=str(tmp_path), out=str(tmp_path / "o"))
        )


@pytest.mark.slow
def test_warm_start_records_lineage_and_resumes_with_its_tokens(tmp_path):
    """Two steps, then a warm start for one more from that adapter: the child names its parent and counts
    the lineage's steps and tokens; resuming keeps the counts."""
    small = {
        "mixture": {"arithmetic": 1.0},
        "tokens_per_step": 120,
        "eval_every": 100,
        "checkpoint_every": 1,
        "device": "cpu",
    }
    first = ConvertTrainer(ConvertConfig(out=str(tmp_path / "a"), max_steps=2, **small)).run()
    parent = json.loads((tmp_path / "a" / "adapter" / "clover_adapter.json").read_text())
    assert parent["parent"] is None and parent["total_steps"] == 2 and parent["device"].startswith("cpu")
    assert parent["tokens"]["clean"] > 0 and parent["tokens"]["noisy"] > 0
    assert (
        parent["total_tokens"]
        == parent["tokens"]["clean"] + parent["tokens"]["noisy"]
        == first["total_tokens"]
    )
    with pytest.raises(CloverError, match="a diffusion adapter of rank 32, but this run trains a ar adapter"):
        ConvertTrainer(
            ConvertConfig(
                out=str(tmp_path / "x"), objective="ar", init_adapter=str(tmp_path / "a" / "adapter"), **small
            )
        )
    child_cfg = ConvertConfig(
        out=str(tmp_path / "b"), max_steps=1, init_adapter=str(tmp_path / "a" / "adapter"), **small
    )
    child = ConvertTrainer(child_cfg)
    adapter_weights = {k: v for k, v in child.model.named_parameters() if "lora_B" in k}
    assert any(v.abs().max() > 0 for v in adapter_weights.values())  # LoRA B starts at zero: these are loaded
    child.run()
    meta = json.loads((tmp_path / "b" / "adapter" / "clover_adapter.json").read_text())
    assert (
        meta["parent"] == adapter_lineage(tmp_path / "a" / "adapter")
        and meta["steps"] == 1
        and meta["total_steps"] == 3
    )
    assert meta["total_tokens"] == parent["total_tokens"] + meta["tokens"]["clean"] + meta["tokens"]["noisy"]
    # a resumed run may be taught another mixture (the campaign's --mixture), not another schedule
    resumed = ConvertTrainer(
        ConvertConfig(**(child_cfg.__dict__ | {"max_steps": 2, "mixture": {"chat": 1.0}})), resume=True
    )
    assert resumed.tokens == meta["tokens"] and resumed.parent == meta["parent"]
    with pytest.raises(CloverError, match="different configuration than the checkpoint's: lr"):
        ConvertTrainer(ConvertConfig(**(child_cfg.__dict__ | {"lr": 1e-3})), resume=True)


def test_trajectories_are_written_as_they_arrive_and_resume(tokenizer, random_model, tmp_path):
    """The engine's batched one-token-a-step answers, each with its scores; a rerun adds only the missing."""
    from cloverlm.training.conversion.distill import make_trajectories, read_done

    path = tmp_path / "trajectories.jsonl"
    first = make_trajectories(random_model, tokenizer, path, 2, {"arithmetic": 1.0}, batch_size=2)
    assert first["tried"] == 2 and sorted(r["index"] for r in read_done(path)) == [0, 1]
    record = read_done(path)[0]
    assert set(record) == {"index", "task", "seed", "prompt_ids", "answer_ids", "kept", "scores"}
    assert record["kept"] == (record["scores"]["exact"] == 1.0) and record["task"] == "arithmetic"
    make_trajectories(random_model, tokenizer, path, 3, {"arithmetic": 1.0}, batch_size=2)
    assert sorted(r["index"] for r in read_done(path)) == [0, 1, 2]  # index 0 and 1 were not decoded again


@pytest.mark.slow
def test_the_distill_recipe_trains_on_kept_trajectories(base_tokenizer, tmp_path):
    """`clover train --recipe distill` end to end on a trajectories file already complete (one kept
    answer: a reference answer standing in for a right one), so no decoding runs: a step with certainty
    forcing, and the adapter names its parent."""
    from cloverlm.evaluation.heldout import encode_example

    out = tmp_path / "distill"
    out.mkdir()
    mixture = ConvertConfig().mixture
    lines = []
    for index in range(2):
        example = trajectory_example(index, mixture, 0, 0.3)
        encoded = encode_example(base_tokenizer, example)
        answer = encoded.ids[encoded.prompt_length : -1]  # without the end of turn, as the engine returns it
        lines.append(json.dumps({"index": index, "task": example.task, "seed": example.seed, "kept": index == 0, "scores": {},
                                 "prompt_ids": encoded.ids[: encoded.prompt_length], "answer_ids": answer}))  # fmt: skip
    (out / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "cloverlm", "train", "--recipe", "distill", "--init-adapter", str(BASE_TOKENIZER),
               "--out", str(out), "--trajectories", "2", "--max-steps", "1", "--tokens-per-step", "200", "--eval-every", "0", "--threads", "2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"tried": 2, "kept": 1' in done.stdout
    meta = json.loads((out / "adapter" / "clover_adapter.json").read_text())
    assert meta["config"]["certainty_weight"] == 0.5 and meta["config"]["mixture"] == {
        "distill": 0.75,
        "chat": 0.25,
    }
    assert (
        meta["parent"]["path"] == str(BASE_TOKENIZER)
        and meta["total_steps"] == meta["parent"]["total_steps"] + 1
    )
    assert not (out / "adapter" / "tokenizer.json").exists()  # trained with the base's tokenizer: not copied
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert "certainty_entropy" in log[0]
