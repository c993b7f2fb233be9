"""The README's structured-extraction examples, for real: the shipped Clover behind `clover serve`, a no_fly
request through the official openai client with the task's own (grounded) answer schema and the
calibrated block size ("auto"), and issue 29's reproduction, which ran on forever before answers had to close."""

import json

import jsonschema
import openai
import pytest
import torch

from cloverlm import tasks
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.decoding.calibration import load_calibration
from cloverlm.decoding.grounding import without_grounding
from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE
from cloverlm.paths import MODELS
from cloverlm.serving.app import create_app
from cloverlm.serving.background import background_server
from cloverlm.serving.schemas import ServerConfig

KEY = "test-key"


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(2)
    folder = MODELS / "smollm2-clover"
    return load_model(folder), load_folder_tokenizer(folder)


@pytest.mark.slow
def test_a_no_fly_request_with_the_task_schema_returns_schema_valid_zones_at_the_calibrated_block_size(shipped):
    model, tokenizer = shipped
    example = tasks.generate("no_fly_zones", HELDOUT_SEED_BASE, n_messages=8)
    schema = tasks.get_task("no_fly_zones").answer_schema(example)
    calibration = load_calibration(MODELS / "smollm2-clover")
    app = create_app(model, tokenizer, ServerConfig(model_name="clover", api_key=KEY), calibration)
    with background_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        result = client.chat.completions.create(
            model="clover", messages=[{"role": "user", "content": example.prompt}], max_tokens=1024,
            response_format={"type": "json_schema", "json_schema": {"name": "zones", "schema": schema, "strict": True}},
            extra_body={"block_size": "auto", "threshold": 0.9},
        )
    choice = result.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    zones = json.loads(choice.message.content)
    jsonschema.validate(zones, schema)
    assert result.usage.completion_tokens > 0 and len(zones) <= 8
    for zone in zones:  # grounded: every copied value stands in the messages
        assert all((value if isinstance(value, str) else json.dumps(value)) in example.prompt for value in zone.values())


ZONE = {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}, "radius_km": {"type": "number"}},
        "required": ["lat", "lon", "radius_km"], "additionalProperties": False}


@pytest.mark.slow
def test_the_issue_29_reproduction_closes_at_every_block_size(shipped):
    """At 135493c the shipped model wrote radius_km 5.97000… until max_tokens; now the answer parses,
    plain or grounded, at every block size (the grounded one with the prompt's own numbers)."""
    model, tokenizer = shipped
    text = "No-fly zone: 5 km around 39.9N 116.4E. Give it as JSON."
    grounded = {**ZONE, "properties": {key: {**value, "x-grounded": True} for key, value in ZONE["properties"].items()}}
    app = create_app(model, tokenizer, ServerConfig(model_name="clover", api_key=KEY))
    with background_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        for block_size in (1, 2, 4, 8, 16, model.config.max_block_size):
            for schema in (ZONE, grounded):
                result = client.chat.completions.create(
                    model="clover", messages=[{"role": "user", "content": text}], max_tokens=64,
                    response_format={"type": "json_schema", "json_schema": {"name": "zone", "schema": schema, "strict": True}},
                    extra_body={"block_size": block_size},
                )
                choice = result.choices[0]
                assert choice.finish_reason == "stop", (block_size, choice.message.content)
                zone = json.loads(choice.message.content)
                jsonschema.validate(zone, without_grounding(schema))
                if schema is grounded:  # only the prompt's numbers; the shipped model picks the right ones at 1 and 16
                    assert all(json.dumps(value) in text for value in zone.values()), (block_size, zone)
                    if block_size in (1, 16):
                        assert zone == {"lat": 39.9, "lon": 116.4, "radius_km": 5}
