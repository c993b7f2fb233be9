"""The block-diffusion objective, the data mixture, the simple decoder, checkpoints and exact resume."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from cloverlm import CloverError
from cloverlm.cli import main
from cloverlm.convert.load import load_model
from cloverlm.model.checkpoint import save_model
from cloverlm.model.config import CHUNK_SIZE
from cloverlm.model.layout import block_partition, fixed_partition
from cloverlm.training.scratch.diffusion import diffusion_loss, mask_blocks
from conftest import losses, tiny_model


def test_partition_covers_sequence_without_crossing_chunks():
    g = torch.Generator().manual_seed(0)
    for length in (64, 100, 2368):
        sizes = block_partition(length, [1, 4, 8, 16, 32], g, chunk=CHUNK_SIZE)
        assert sum(sizes) == length and set(sizes) <= {1, 4, 8, 16, 32}
        ends = torch.tensor(sizes).cumsum(0)
        starts = ends - torch.tensor(sizes)
        assert ((starts // 64) == ((ends - 1) // 64)).all()
    with pytest.raises(CloverError, match="must include 1"):
        block_partition(64, [4, 8], g, chunk=CHUNK_SIZE)
    assert fixed_partition(64, 5) == [5] * 12 + [4] and fixed_partition(64, 16) == [16] * 4
    with pytest.raises(CloverError, match="block size must be at least 1"):
        fixed_partition(64, 0)


def test_masking_per_block_and_complementary():
    """Shifted convention: targets are masked per block; a masked target is [MASK] at the next input
    position unless that position opens a block; every block's last slot is scored."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 100, (4, 65))
    eligible = torch.ones_like(ids, dtype=torch.bool)
    eligible[:, :10] = False  # a chat prompt
    noised = mask_blocks(ids, eligible, [16] * 4, 2, g)
    assert torch.equal(noised.clean_ids, ids[:, :-1]) and torch.equal(noised.targets, ids[:, 1:])
    assert not noised.scored[:, :9].any()  # prompt targets are never scored
    masked = noised.weight != 1
    hidden = noised.noisy_ids == 2
    assert torch.equal(hidden[:, 1:], masked[:, :-1] & (torch.arange(1, 64) % 16 != 0))
    assert not hidden[:, ::16].any()  # a block's first slot always holds its clean token
    assert noised.scored[:, 15::16].all() and torch.equal(noised.scored, masked | (torch.arange(64) % 16 == 15))
    inverse_t = noised.weight.masked_fill(~masked, float("nan")).view(4, 4, 16)
    for row in range(4):
        for block in range(4):
            values = inverse_t[row, block][~inverse_t[row, block].isnan()]
            assert values.numel() == 0 or torch.allclose(values, values[:1])  # one t per block
    full = mask_blocks(ids, eligible, [1] * 64, 2, g, t_fixed=1.0)
    assert torch.equal(full.scored, eligible[:, 1:]) and torch.equal(full.noisy_ids, full.clean_ids)
    pair = mask_blocks(ids, eligible, [16] * 4, 2, g, complementary=True)
    first, second = (pair.weight != 1).chunk(2)
    assert torch.equal(first ^ second, eligible[:, 1:]) and not (first & second).any()
    with pytest.raises(CloverError, match="give 64 input positions"):
        mask_blocks(ids, eligible, [16] * 4 + [1], 2, g)


def test_block_size_one_fully_masked_is_next_token_loss():
    model = tiny_model()
    ids = torch.randint(3, 300, (2, 25))
    eligible = torch.ones_like(ids, dtype=torch.bool)
    noised = mask_blocks(ids, eligible, [1] * 24, 2, torch.Generator(), t_fixed=1.0)
    with torch.no_grad():
        loss, _, _ = diffusion_loss(model, noised, [1] * 24)
        # independent computation: token i + 1 predicted from the clean tokens <= i only
        expected = []
        for i in range(24):
            prefix = ids[:, : i + 1]
            logits = model(prefix, prefix, [1] * (i + 1)).logits[:, i]
            expected.append(F.cross_entropy(logits, ids[:, i + 1], reduction="none"))
    torch.testing.assert_close(loss, torch.stack(expected).mean(), atol=1e-5, rtol=1e-5)


def test_elbo_weights_by_inverse_t():
    model = tiny_model()
    ids = torch.randint(3, 300, (1, 17))
    eligible = torch.ones_like(ids, dtype=torch.bool)
    g = torch.Generator().manual_seed(3)
    noised = mask_blocks(ids, eligible, [16], 2, g, t_fixed=0.25)
    masked = (noised.weight == 4)[0]
    assert 0 < masked.sum() < 16
    with torch.no_grad():
        loss, _, _ = diffusion_loss(model, noised, [16])
        logits = model(noised.clean_ids, noised.noisy_ids, [16]).logits[0]
    nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")
    expected = (4 * nll[masked].sum() + (0 if masked[-1] else nll[-1])) / 16
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_bad_checkpoints_get_one_line_errors(tmp_path, model):
    save_model(model, None, tmp_path / "good")
    weights = (tmp_path / "good" / "model.safetensors").read_bytes()
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(CloverError, match="corrupt or truncated"):
        load_model(truncated)
    (truncated / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(CloverError, match="corrupt or truncated"):
        load_model(truncated)
    pickled = tmp_path / "model.pt"
    pickled.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(CloverError, match="looks like a pickle"):
        load_model(pickled)
    disguised = tmp_path / "weights.safetensors"  # recognised by its first bytes, not its name
    disguised.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(CloverError, match="looks like a pickle"):
        load_model(disguised)
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({}))
    with pytest.raises(CloverError, match="pickle checkpoints are refused"):
        load_model(folder)
    with pytest.raises(CloverError, match="the folder does not exist"):
        load_model(tmp_path / "missing")
    (truncated / "model.safetensors").write_bytes(weights)
    (truncated / "config.json").write_text("{not json")
    with pytest.raises(CloverError, match="unreadable config.json"):
        load_model(truncated)


def clover(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "cloverlm", *args], capture_output=True, text=True, **kwargs)


CLI_ERRORS = [
    (["generate", "   "], "error: empty prompt"),
    (["generate", "--model", "/nonexistent/model", "hello"], "error: no model at /nonexistent/model"),
    (["info", "clover-7b"], "error: unknown preset 'clover-7b'"),
]


@pytest.mark.parametrize("args, message", CLI_ERRORS)
def test_cli_errors_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as raised:
        main(args)
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(message) and error.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("args, message", CLI_ERRORS)
def test_cli_errors_are_one_line_from_the_entry_point(args, message):
    result = clover(*args)
    assert result.returncode == 2
    assert result.stderr.strip() == result.stderr.strip().splitlines()[0]
    assert result.stderr.startswith(message)


def test_info_json_reports_counts(capsys):
    main(["info", "clover-35b-a3b", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert 33e9 < info["total_params"] < 37e9 and 2.85e9 < info["active_params"] < 3.15e9


TRAIN_ARGS = [
    "--seq-len", "512", "--batch-size", "2", "--eval-every", "4", "--probe-examples", "1",
    "--checkpoint-every", "1", "--max-steps", "7", "--threads", "1",
    "--set", "hidden_size=32", "--set", "num_experts=4", "--set", "moe_intermediate_size=16",
    "--set", "shared_expert_intermediate_size=32", "--set", "linear_key_head_dim=8",
    "--set", "linear_value_head_dim=8", "--set", "head_dim=8",
]  # fmt: skip


@pytest.mark.slow
def test_resume_after_sigkill_replays_the_same_losses(tmp_path, small_tokenizer):
    common = [*TRAIN_ARGS, "--tokenizer", str(small_tokenizer)]
    reference = clover("train", "--out", str(tmp_path / "ref"), *common, timeout=600)
    assert reference.returncode == 0, reference.stderr[-2000:]
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "cloverlm", "train", "--out", str(killed), *common],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and len(losses(killed) if (killed / "train_log.jsonl").exists() else {}) < 4:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert len(losses(killed)) < 7, "the run finished before it could be killed"
    again = clover("train", "--out", str(killed), *common)
    assert again.returncode == 2 and "pass --resume" in again.stderr
    resumed = clover("train", "--out", str(killed), *common, "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(killed) == losses(tmp_path / "ref")
    assert len(losses(killed)) == 7


@pytest.mark.slow
def test_minutes_budget_becomes_a_fixed_step_count(tmp_path, small_tokenizer):
    args = [a for a in TRAIN_ARGS if a not in ("--max-steps", "7")]
    result = clover("train", "--out", str(tmp_path / "run"), *args, "--minutes", "0.3", "--tokenizer", str(small_tokenizer), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    calibrated = [r for r in records if r.get("event") == "calibrated"]
    assert len(calibrated) == 1 and calibrated[0]["max_steps"] >= 1
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(calibrated[0]["max_steps"]))  # the probe steps are not logged nor kept


@pytest.mark.slow
def test_init_from_starts_at_the_given_weights(tmp_path, small_tokenizer):
    from safetensors.torch import load_file

    from cloverlm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(small_tokenizer)
    start = tiny_model(
        vocab_size=len(tokenizer), hidden_size=32, num_experts=4, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8,
    )  # fmt: skip
    save_model(start, tokenizer, tmp_path / "start")
    args = ["--seq-len", "512", "--batch-size", "1", "--max-steps", "1", "--lr", "0", "--probe-examples", "1", "--threads", "1"]
    result = clover("train", "--out", str(tmp_path / "run"), "--init-from", str(tmp_path / "start"), *args, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    before = load_file(str(tmp_path / "start" / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    for name, tensor in before.items():
        if not name.endswith("expert_bias"):  # the balancing bias moves even at lr 0
            torch.testing.assert_close(after[name], tensor, msg=name)
