"""GPU window, step 4's second half (run by collect.sh, here): turns the returned pieces into checkpoints
that `clover campaign --minutes 0 --out OUT` resumes, trains no step on, evaluates and promotes.

  python scripts/gpu_window/rebuild.py FILES_AT OUT MODELS DEVICE

For each run: the bf16 adapter (joined by split.py) is checked against the shipped adapter (same keys
and shapes) and stored in fp32; the optimizer comes back empty (its 74 MB a run cannot come back: the
checkpoint evaluates and promotes exactly, while training on from it starts AdamW afresh, like a warm
start); the stored config's machine-specific fields (out, device, init_adapter) become what this
machine's `clover campaign --out OUT --models MODELS --device DEVICE` computes (any other difference
is an error); the train log is cut at the checkpoint's step. Prints each run's steps and tokens.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cloverlm.training.conversion.campaign import SHIPPED, CampaignConfig, trainer_config

LOCAL_FIELDS = ("out", "device", "init_adapter")


def _step(line: str) -> float:
    """A log line's step (0 for events without one; infinity for a line cut short by a kill: dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return float("inf")


files_at, out, models, device = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
steps = {}
for objective, name in SHIPPED.items():
    run = Path(out) / name
    ck = run / "checkpoint"
    adapter = load_file(str(ck / "adapter_model.safetensors"))
    shipped = Path(models) / name / "adapter_model.safetensors"
    with safe_open(str(shipped), framework="pt") as handle:
        want = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
    got = {k: tuple(v.shape) for k, v in adapter.items()}
    if got != want:
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        bad = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
        sys.exit(
            f"{name}: returned adapter does not fit {shipped}: missing {missing[:3]}, extra {extra[:3]}, shapes {bad[:3]}"
        )
    if any(v.dtype != torch.float32 or not torch.isfinite(v).all() for v in adapter.values()):
        sys.exit(f"{name}: the joined adapter is not finite fp32")
    save_file({}, str(ck / "optimizer.safetensors"), metadata={"format": "pt"})
    state = json.loads((ck / "train_state.json").read_text())
    stored = state["config"]
    resolved = (
        "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    )  # run_campaign's
    cfg = CampaignConfig(minutes=0, out=out, models=models, device=device)
    expected = asdict(trainer_config(cfg, objective, resolved))
    expected |= {"minutes": stored["minutes"], "max_steps": stored["max_steps"]}  # free to differ on resume
    other = sorted(k for k in expected if k not in LOCAL_FIELDS and stored.get(k) != expected[k])
    if other:
        sys.exit(
            f"{name}: the GPU run's config differs from this checkout's in {other} (src changed in between?)"
        )
    device_fields = {k: stored.get(k) for k in LOCAL_FIELDS}
    stored |= {k: expected[k] for k in LOCAL_FIELDS}
    state["optimizer"]["state"] = {}
    (ck / "train_state.json").write_text(json.dumps(state, indent=1))
    step = steps[name] = state["state"]["step"]
    log = run / "train_log.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    kept = [line for line in lines if _step(line) <= step]
    log.write_text("".join(line + "\n" for line in kept))
    note = {"from": str(files_at), "device_config": device_fields, "optimizer": "not returned: AdamW state emptied",
            "adapter": "returned in bf16, stored as fp32", "log_lines_cut": len(lines) - len(kept)}  # fmt: skip
    (run / "gpu_window.json").write_text(json.dumps(note, indent=1) + "\n")
    print(
        f"{name}: step {step}, tokens {state['state'].get('tokens')}, {len(adapter)} tensors checked, "
        f"log {len(kept)} lines ({len(lines) - len(kept)} past the checkpoint cut), trained on {device_fields['device']}"
    )
clover, peer = steps[SHIPPED["diffusion"]], steps[SHIPPED["ar"]]
if peer != clover:
    print(
        f"WARNING: the peer stopped at step {peer}, Clover at {clover}: `clover campaign --minutes 0` would train "
        f"the peer {clover - peer} steps on this CPU at the GPU's step shape first (slow)."
    )
    sys.exit(3)
