import json
from pathlib import Path

import pytest
import torch

from cloverlm import CloverForBlockDiffusion, preset_config
from cloverlm.tokenizer import load_tokenizer

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    num_experts=8,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    head_dim=16,
)


def tiny_model(preset: str = "clover-tiny", seed: int = 0, **overrides) -> CloverForBlockDiffusion:
    """A random tiny model; weights are jittered so that gates and routers are far from their init."""
    torch.manual_seed(seed)
    model = CloverForBlockDiffusion(preset_config(preset, **{**TINY, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # CI has 2 cores and several tests run a server or a subprocess beside the model: more threads
    # only contend (seen: one test 5.7 s with 1 thread, 364 s with 2 on a loaded machine)
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    """The shipped tokenizer: real special tokens and chat template, for tiny random models."""
    return load_tokenizer("models/scratch-tokenizer")


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """A folder with a tokenizer built by the default recipe at a small vocabulary (fast to embed)."""
    from cloverlm.training.scratch.data import build_default_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_default_tokenizer(vocab_size=2048, task_samples=20).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def random_model(tokenizer):
    """A tiny random model over the shipped tokenizer's vocabulary."""
    return tiny_model(vocab_size=len(tokenizer))


@pytest.fixture
def model():
    return tiny_model()


def losses(run: Path) -> dict[int, float]:
    """Step -> logged training loss of a run folder (shared by the resume and distributed tests)."""
    out = {}
    for line in (run / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]  # a replayed step overwrites the killed run's entry
    return out
