"""The shared training loop (training/loop.py): a run interrupted after k steps and resumed takes the steps
of an uninterrupted one (the same log and weights), for a toy objective, the conversion objective and the
from-scratch one; the schedule, evaluation cadence, --minutes and the refusals of a run's folder."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cloverlm.errors import CloverError
from cloverlm.training.loop import Loop, lr_at

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("tok_s", "elapsed_s", "rss_gib", "peak_rss_gib")  # what the machine measured, not the run


def logged(run: Path) -> list[dict]:
    """The log without wall-clock fields; a replayed step replaces the interrupted run's line of it."""
    records = {}
    for line in (run / "train_log.jsonl").read_text().splitlines():
        record = {k: v for k, v in json.loads(line).items() if k not in TIMING}
        records[record.get("event", "step"), record.get("step")] = record
    return sorted(records.values(), key=lambda r: (r.get("step", -1), "event" in r))


def crash_at(cls, step: int, monkeypatch):
    real = cls.train_step

    def train_step(self, index, batch=None):
        if index == step:
            raise RuntimeError("simulated crash")
        return real(self, index, batch)

    monkeypatch.setattr(cls, "train_step", train_step)


def assert_only_safetensors_and_json(folder: Path):
    for path in folder.rglob("*"):
        if path.is_file():
            assert path.suffix in (".safetensors", ".json", ".jinja", ".txt"), path


# ----------------------------------------------------------------------------------------------
# A toy objective: linear regression on batches that are a pure function of (seed, step)


@dataclass
class ToyConfig:
    out: str
    max_steps: int | None = 6
    minutes: float | None = None
    lr: float = 0.05
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 2
    checkpoint_every: int | None = 1
    checkpoint_minutes: float = 5.0
    seed: int = 0


class Toy(Loop):
    def __init__(self, cfg: ToyConfig, resume: bool = False):
        super().__init__(cfg, resume, rows_seen=0)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        if self.resumed is not None:
            self.model.load_state_dict(load_file(str(self.resumed / "toy.safetensors")))
        self.start()

    def param_groups(self):
        return [{"params": list(self.model.parameters()), "weight_decay": 0.01}]

    def batch(self, step):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(self.cfg.seed * 1000 + step))
        return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def loss(self, batch, step):
        x, y = batch
        return ((self.model(x) - y) ** 2).mean(), None

    def after_step(self, batch, total, out):
        self.state["rows_seen"] += 8
        return {"loss": float(total.detach()), "tokens": 8}

    def evaluate(self):
        return {"weight_sum": float(self.model.weight.sum())}

    def save_weights(self, folder):
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(folder / "toy.safetensors"))


def toy_weights(run: Path) -> dict:
    return load_file(str(run / "checkpoint" / "toy.safetensors"))


def test_a_resumed_toy_run_takes_the_steps_of_an_uninterrupted_one(tmp_path, monkeypatch):
    reference = Toy(ToyConfig(out=str(tmp_path / "ref"))).run()
    assert reference == {"steps": 6}
    log = logged(tmp_path / "ref")
    steps = [r for r in log if "event" not in r]
    assert [r["step"] for r in steps] == list(range(6))
    assert [r["lr"] for r in steps] == [lr_at(s, ToyConfig(out=""), 6) for s in range(6)]
    assert steps[0]["lr"] < steps[1]["lr"] and steps[1]["lr"] > steps[5]["lr"]  # warm-up, then the cosine
    assert [r["step"] for r in log if r.get("event") == "eval"] == [2, 4, 6]

    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        crash_at(Toy, 3, patch)
        Toy(ToyConfig(out=str(tmp_path / "run"))).run()
    with pytest.raises(CloverError, match="already holds a run; pass --resume"):
        Toy(ToyConfig(out=str(tmp_path / "run")))
    with pytest.raises(CloverError, match="--resume: no checkpoint in"):
        Toy(ToyConfig(out=str(tmp_path / "none")), resume=True)
    resumed = Toy(ToyConfig(out=str(tmp_path / "run")), resume=True)
    assert resumed.state["step"] == 3 and resumed.state["rows_seen"] == 24
    resumed.run()
    assert logged(tmp_path / "run") == log
    for name, tensor in toy_weights(tmp_path / "ref").items():
        assert torch.equal(toy_weights(tmp_path / "run")[name], tensor), name
    state = json.loads((tmp_path / "run" / "checkpoint" / "train_state.json").read_text())
    assert state["state"] == {"step": 6, "max_steps": 6, "rows_seen": 48} and state["config"]["lr"] == 0.05
    assert_only_safetensors_and_json(tmp_path / "run" / "checkpoint")


def test_a_run_taken_in_pieces_evaluates_where_one_call_does(tmp_path):
    """stop_at (a chunk's end, the peer stopping at Clover's step) is no evaluation point: the schedule's is."""
    whole = ToyConfig(out=str(tmp_path / "whole"), eval_every=4)
    Toy(whole).run()
    pieces = ToyConfig(out=str(tmp_path / "pieces"), eval_every=4)
    assert Toy(pieces).run(stop_at=3) == {"steps": 3}
    Toy(pieces, resume=True).run(stop_at=6)
    assert [r["step"] for r in logged(tmp_path / "whole") if r.get("event") == "eval"] == [4, 6]
    assert logged(tmp_path / "pieces") == logged(tmp_path / "whole")


def test_eval_every_zero_evaluates_never_not_even_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(Toy, "evaluate", lambda self: pytest.fail("evaluated with eval_every=0"))
    assert Toy(ToyConfig(out=str(tmp_path / "run"), eval_every=0)).run() == {"steps": 6}
    assert [r["step"] for r in logged(tmp_path / "run") if "event" not in r] == list(range(6))


def test_minutes_alone_calibrate_a_step_count_and_beside_one_limit_the_run(tmp_path):
    calibrated = Toy(ToyConfig(out=str(tmp_path / "cal"), max_steps=None, minutes=2e-4, checkpoint_every=None))
    calibrated.run()
    (event,) = [r for r in logged(tmp_path / "cal") if r.get("event") == "calibrated"]
    steps = event["max_steps"]
    # the timed steps were undone: the same run as one given that step count
    Toy(ToyConfig(out=str(tmp_path / "ref"), max_steps=steps, checkpoint_every=None)).run()
    drop = lambda log: [r for r in log if r.get("event") != "calibrated"]  # noqa: E731
    assert drop(logged(tmp_path / "cal")) == logged(tmp_path / "ref")
    assert calibrated.state["rows_seen"] == 8 * steps

    stopped = Toy(ToyConfig(out=str(tmp_path / "stop"), minutes=0.0)).run()  # past its time before a step
    assert stopped == {"steps": 0} and (tmp_path / "stop" / "checkpoint" / "toy.safetensors").is_file()
    Toy(ToyConfig(out=str(tmp_path / "stop")), resume=True).run()
    Toy(ToyConfig(out=str(tmp_path / "whole"))).run()
    assert logged(tmp_path / "stop") == logged(tmp_path / "whole")


# ----------------------------------------------------------------------------------------------
# The conversion objective on a tiny random Llama with the packaged base's tokenizer


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cloverlm.convert.base import base_tokenizer

    tokenizer = base_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["diffusion", "ar"])
def test_a_resumed_conversion_run_takes_the_steps_of_an_uninterrupted_one(tiny_base, tmp_path, monkeypatch, objective):
    from cloverlm.training.conversion.trainer import ConvertConfig, ConvertTrainer

    def config(out, **changes):
        torch.manual_seed(0)  # LoRA's random init draws from the global generator (a resume loads it instead)
        return ConvertConfig(base=tiny_base, objective=objective, out=str(tmp_path / out), mixture={"arithmetic": 1.0},
                             tokens_per_step=120, max_steps=3, eval_every=2, checkpoint_every=2, device="cpu",
                             lora_rank=4, lora_alpha=8, **changes)  # fmt: skip

    def trainer(out, resume=False):
        made = ConvertTrainer(config(out), resume=resume)
        made.heldout = made.heldout[-1:]  # one short held-out prompt: the 20-message ones take seconds each
        return made

    summary = trainer("ref").run()
    log = logged(tmp_path / "ref")
    assert [r["step"] for r in log] == [1, 2, 3]  # steps done, as the conversion logs count them
    assert [("eval_ar_nll" in r) for r in log] == [False, True, True]  # every 2 steps, and the last
    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        crash_at(ConvertTrainer, 2, patch)
        trainer("run").run()
    with pytest.raises(CloverError, match=r"configuration than the checkpoint's: lr \(only max_steps, minutes, out, init_adapter, device, mixture, chat_examples, noisy_draws may change\)"):
        ConvertTrainer(config("run", lr=1e-3), resume=True)
    shutil.move(tmp_path / "run", tmp_path / "moved")  # a run goes on in another folder (another session)
    resumed = trainer("moved", resume=True)
    assert resumed.step == 2
    assert resumed.run() == summary | {"out": str(tmp_path / "moved" / "adapter")}
    assert logged(tmp_path / "moved") == log
    meta = json.loads((tmp_path / "moved" / "adapter" / "clover_adapter.json").read_text())
    assert meta["steps"] == meta["total_steps"] == 3 and meta["parent"] is None
    assert meta["total_tokens"] == sum(meta["tokens"].values()) > 0
    assert (meta["tokens"]["noisy"] > 0) == (objective == "diffusion")  # the peer computes no noisy slots
    for kind in ("checkpoint", "adapter"):
        want = load_file(str(tmp_path / "ref" / kind / "adapter_model.safetensors"))
        got = load_file(str(tmp_path / "moved" / kind / "adapter_model.safetensors"))
        assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want), kind
    assert_only_safetensors_and_json(tmp_path / "moved" / "checkpoint")


# ----------------------------------------------------------------------------------------------
# From scratch: Clover on the shipped scratch tokenizer, the stdlib replaced by random tokens


@pytest.mark.slow
def test_a_resumed_scratch_run_takes_the_steps_of_an_uninterrupted_one(tmp_path, monkeypatch):
    from cloverlm.training.scratch import train
    from cloverlm.training.scratch.recipe import TrainConfig

    def tokenize_stdlib(tokenizer, split, every=1):  # the same tokens in every run, without reading the stdlib
        return torch.randint(10, 2000, (4096,), generator=torch.Generator().manual_seed(len(split)))

    monkeypatch.setattr(train, "tokenize_stdlib", tokenize_stdlib)
    overrides = dict(hidden_size=32, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                     linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8)  # fmt: skip

    def config(out):
        return TrainConfig(out=str(tmp_path / out), tokenizer=str(ROOT / "models" / "scratch-tokenizer"), seq_len=512,
                           max_steps=3, eval_every=2, checkpoint_every=1, probe_examples=1, bf16=False,
                           overrides=overrides)  # fmt: skip

    train.Trainer(config("ref")).run()
    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        crash_at(train.Trainer, 2, patch)
        train.Trainer(config("run")).run()
    train.Trainer(config("run"), resume=True).run()
    log = logged(tmp_path / "ref")
    assert logged(tmp_path / "run") == log
    assert [r["step"] for r in log if "event" not in r] == [0, 1, 2]
    assert [r["step"] for r in log if r.get("event") == "eval"] == [2, 3]
    want = load_file(str(tmp_path / "ref" / "checkpoint" / "model.safetensors"))
    got = load_file(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert_only_safetensors_and_json(tmp_path / "run" / "checkpoint")
