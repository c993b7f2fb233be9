"""The README's structured-extraction example, for real: the shipped Clover behind `clover serve`, a no_fly
request through the official openai client with the task's own answer schema, block size 16."""

import json

import jsonschema
import openai
import pytest
import torch

from cloverlm import tasks
from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE
from cloverlm.paths import MODELS
from cloverlm.serving.app import create_app
from cloverlm.serving.background import background_server
from cloverlm.serving.schemas import ServerConfig

KEY = "test-key"


@pytest.mark.slow
def test_a_no_fly_request_with_the_task_schema_returns_schema_valid_zones_at_block_16():
    torch.set_num_threads(2)
    folder = MODELS / "smollm2-clover"
    model, tokenizer = load_model(folder), load_folder_tokenizer(folder)
    example = tasks.generate("no_fly_zones", HELDOUT_SEED_BASE, n_messages=8)
    schema = tasks.get_task("no_fly_zones").answer_schema(example)
    app = create_app(model, tokenizer, ServerConfig(model_name="clover", api_key=KEY))
    with background_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        result = client.chat.completions.create(
            model="clover", messages=[{"role": "user", "content": example.prompt}], max_tokens=1024,
            response_format={"type": "json_schema", "json_schema": {"name": "zones", "schema": schema, "strict": True}},
            extra_body={"block_size": 16, "threshold": 0.9},
        )
    choice = result.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    zones = json.loads(choice.message.content)
    jsonschema.validate(zones, schema)
    assert result.usage.completion_tokens > 0 and len(zones) <= 8
