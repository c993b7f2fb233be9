"""`clover info --plan N`: per-GPU memory arithmetic against numbers worked out by hand."""

import json

import pytest

from cloverlm import CloverError, preset_config
from cloverlm.cli import main
from cloverlm.model.config import parameter_counts
from cloverlm.model.plan import GIB, memory_plan


def test_serving_numbers_for_35b_on_8_gpus():
    s = memory_plan(preset_config("clover-35b-a3b"), 8, context=32768)["serving"]
    # 256 experts over 8 GPUs: 32 per layer; 40 layers x 32 x (3 x 2048 x 512) params x 2 bytes
    assert s["experts_per_gpu"] == 32
    assert s["expert_weights"] == 40 * 32 * 3_145_728 * 2 == 8_053_063_680
    # 30 memory layers x 32 heads x 128 x 128 fp32; conv tail: radius 2 x (2 x 16 x 128 + 32 x 128) bf16
    assert s["memory_state_per_request"] == 30 * 32 * 128 * 128 * 4 == 62_914_560
    assert s["conv_tail_per_request"] == 30 * 2 * 8192 * 2 == 983_040
    # 10 attention layers x (k and v: 2 heads x 256) x 2 bytes = 20 KiB per token
    assert s["kv_per_token"] == 20_480
    assert s["cache_per_request"] == 62_914_560 + 983_040 + 20_480 * 32768
    assert s["weights"] == s["expert_weights"] + s["replicated_weights"]


def test_training_states_are_sharded():
    config = preset_config("clover-1b-a0.3b")
    total = parameter_counts(config)["total_params"]
    one, four = (memory_plan(config, n)["training"] for n in (1, 4))
    # 2 + 4 + 8 + 4 bytes per parameter, split four ways
    assert one["weights_bf16"] + one["master_fp32"] + one["adam_fp32"] + one["grads_fp32"] == 18 * total
    assert four["adam_fp32"] == -(-8 * total // 4)
    # activations do not shrink with more GPUs (each GPU runs its own sequence); states do
    assert four["activations"] == one["activations"]
    assert four["total"] < one["total"]
    # the logits of the masked half: 2048 positions x 151936 x (2 + 4 + 4) bytes
    assert one["activation_parts"]["logits"] == 2048 * 151_936 * 10


def test_cli_plan_json_and_errors(capsys):
    main(["info", "clover-35b-a3b", "--plan", "16", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["plan"]["serving"]["experts_per_gpu"] == 16
    assert 0 < info["plan"]["training"]["total"] < 80 * GIB
    main(["info", "clover-tiny", "--plan", "2"])
    assert "per request" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["info", "clover-tiny", "--plan", "0"])
    assert capsys.readouterr().err.strip() == "error: --plan needs at least 1 GPU, got 0"
    with pytest.raises(CloverError, match="--context must be at least 1 token"):
        memory_plan(preset_config("clover-tiny"), 1, context=0)
