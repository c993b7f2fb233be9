"""`clover serve` end to end: the official openai client against a live server on a free loopback port
with a tiny random model and the shipped tokenizer: completions, chat, streaming, json_schema, tools, the
API key, limits and errors in OpenAI's shape, disconnects, concurrent clients, and schemathesis."""

import json
import socket
import time
from types import SimpleNamespace

import httpx2
import jsonschema
import openai
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from cloverlm.bench.serving import bench_load, concurrently
from cloverlm.cli import main
from cloverlm.convert.peer import build_peer, peer_config, save_peer
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.model.checkpoint import save_model
from cloverlm.serving.app import create_app
from cloverlm.serving.background import background_server
from cloverlm.serving.schemas import ServerConfig
from cloverlm.tokenizer import load_tokenizer, stop_token_ids
from conftest import tiny_model

KEY = "test-key"
NAME = "clover-test"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Bern"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIMER = {"type": "function", "function": {"name": "set_timer", "parameters": {
    "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 90}},
    "required": ["minutes"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["A", "B", "C"]}, "drones": {"type": "array", "maxItems": 3,
          "items": {"type": "integer", "minimum": 1, "maximum": 8}}}, "required": ["zone", "drones"], "additionalProperties": False}
USER = [{"role": "user", "content": "Which zone is free?"}]


def _start(**overrides):
    torch.set_num_threads(1)
    tokenizer = load_tokenizer("models/scratch-tokenizer")
    model = tiny_model(vocab_size=len(tokenizer))
    config = ServerConfig(**{"model_name": NAME, "api_key": KEY, "max_prompt_tokens": 256, "max_tokens": 1024,
                             "default_max_tokens": 16, "max_body_bytes": 32 * 1024, **overrides})
    return model, tokenizer, create_app(model, tokenizer, config)


@pytest.fixture(scope="module")
def served():
    model, tokenizer, app = _start()
    with background_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        http = httpx2.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        yield SimpleNamespace(url=url, app=app, model=model, tokenizer=tokenizer, client=client, http=http)
        http.close()


def _engine_text(served, prompt_ids, **params):
    request = Request(prompt_ids, DecodeParams(stop_token_ids=stop_token_ids(served.tokenizer), **params))
    [completion] = Engine(served.model).generate([request])
    return served.tokenizer.decode(completion.tokens)


def test_models_health_and_metrics(served):
    assert [m.id for m in served.client.models.list()] == [NAME]
    assert httpx2.get(served.url + "/health").json() == {"status": "ok"}
    metrics = httpx2.get(served.url + "/metrics").text
    assert 'clover_requests_total{endpoint="/v1/models",status="200"}' in metrics and "clover_queue_size" in metrics


def test_completions_match_the_engine(served):
    ids = served.tokenizer("The drone flies", add_special_tokens=False)["input_ids"]
    result = served.client.completions.create(model=NAME, prompt="The drone flies", max_tokens=12,
                                              extra_body={"block_size": 4, "threshold": 0.5})
    assert result.choices[0].text == _engine_text(served, ids, max_new_tokens=12, block_size=4, threshold=0.5)
    assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == 12
    batch = dict(model=NAME, prompt=["a b", "c"], n=2, max_tokens=5, temperature=1.0, seed=3)
    first, again = served.client.completions.create(**batch), served.client.completions.create(**batch)
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3] and first.usage.completion_tokens == 20
    assert [c.text for c in again.choices] == [c.text for c in first.choices]  # seeded
    tokens = served.client.completions.create(model=NAME, prompt=ids, max_tokens=12, extra_body={"block_size": 4, "threshold": 0.5})
    assert tokens.choices[0].text == result.choices[0].text


def test_chat_stream_equals_the_whole_answer(served):
    kwargs = dict(model=NAME, messages=USER, max_tokens=24, extra_body={"block_size": 4})
    whole = served.client.chat.completions.create(**kwargs)
    chunks = list(served.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # a block is streamed when it is committed: 24 tokens in blocks of 4 -> up to 6 content chunks, and the
    # finish chunk may carry text held back (a partial UTF-8 character)
    assert 2 <= sum(1 for c in chunks if c.choices and c.choices[0].delta.content) <= 7


def test_stop_strings_cut_whole_and_streamed(served):
    kwargs = dict(model=NAME, messages=USER, max_tokens=30, extra_body={"block_size": 4})
    full = served.client.chat.completions.create(**kwargs).choices[0].message.content
    stop = full[11:14]
    expected = full[: full.index(stop)]
    cut = served.client.chat.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.message.content == expected and cut.finish_reason == "stop"
    streamed = served.client.chat.completions.create(stop=stop, stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_json_schema_whole_and_streamed(served):
    response_format = {"type": "json_schema", "json_schema": {"name": "zones", "schema": SCHEMA, "strict": True}}
    for threshold in (0.9, 0.05):
        result = served.client.chat.completions.create(model=NAME, messages=USER, max_tokens=80, response_format=response_format,
                                                       extra_body={"threshold": threshold, "block_size": 8})
        assert result.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(result.choices[0].message.content), SCHEMA)
    stream = served.client.chat.completions.create(model=NAME, messages=USER, max_tokens=80, response_format=response_format,
                                                   stream=True, temperature=1.0, seed=5)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), SCHEMA)
    # any object: unbounded, yet it closes within the budget (budget-aware closing), even for a random model
    for max_tokens in (12, 200):
        anything = served.client.completions.create(model=NAME, prompt="JSON:", max_tokens=max_tokens, temperature=0.7, seed=1,
                                                    extra_body={"response_format": {"type": "json_object"}})
        assert anything.choices[0].finish_reason == "stop" and isinstance(json.loads(anything.choices[0].text), dict)


def test_grounded_values_come_from_the_prompt(served):
    """x-grounded fields (decoding/grounding.py) through the openai client: a random model can only copy."""
    prompt = "Zone K7 at 61.8719N 24.0324E, radius 5.5 KM, from 0930 to 1130; zone Q2 at 47.25N 8.5E, remarks: parachutes."
    grounded = {"x-grounded": True}
    schema = {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z][0-9]$"} | grounded, "lat": {"type": "number"} | grounded,
        "lon": {"type": "number"} | grounded, "radius": {"type": "number", "minimum": 1} | grounded,
        "until": {"type": "integer"} | grounded, "note": {"type": "string"} | grounded},
        "required": ["zone", "lat", "lon", "radius", "until", "note"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "zone", "schema": schema, "strict": True}}
    for block_size, temperature in ((1, 0.0), (8, 1.0), (16, 0.0)):
        result = served.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=120, response_format=response_format,
            temperature=temperature, seed=3, extra_body={"block_size": block_size})
        choice = result.choices[0]
        answer = json.loads(choice.message.content)
        assert choice.finish_reason == "stop"
        jsonschema.validate(answer, schema)
        for key, value in answer.items():
            assert (value if isinstance(value, str) else json.dumps(value)) in prompt, (key, value)
    nothing = served.http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "no numbers, no zone"}],
                                                  "response_format": response_format})
    error = _error(nothing, 400)
    assert error["code"] == "invalid_schema" and "/properties/zone" in error["message"]


def test_tool_calls(served):
    required = served.client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, TIMER], tool_choice="required",
                                                     max_tokens=120, parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        tool = {"get_weather": WEATHER, "set_timer": TIMER}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = {"type": "function", "function": {"name": "set_timer"}}
    stream = list(served.client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, TIMER], tool_choice=named,
                                                        max_tokens=60, stream=True))
    calls = [call for c in stream if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "set_timer" and calls[0].index == 0
    assert 1 <= json.loads(calls[0].function.arguments)["minutes"] <= 90
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # tools are rendered into the prompt by the chat template
    plain = served.client.chat.completions.create(model=NAME, messages=USER, max_tokens=1)
    auto = served.client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER], max_tokens=1)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert served.client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=4).choices


def test_decisions(served):
    questions = [{"question": f"Which zone does drone {d} take?", "options": ["1", "2", "3"]} for d in (1, 2, 3)]
    body = {"model": NAME, "context": "Three drones, three zones, one drone per zone.", "questions": questions}
    for extra in ({}, {"joint": False}, {"distinct": True}):
        result = served.http.post("/v1/decisions", json={**body, **extra})
        assert result.status_code == 200, result.text
        answers = result.json()["answers"]
        assert [a["index"] for a in answers] == [0, 1, 2] and all(a["answer"] in {"1", "2", "3"} for a in answers)
        assert result.json()["object"] == "decision" and result.json()["usage"]["forwards"] >= 1
    assert len({a["answer"] for a in answers}) == 3  # distinct
    _error(served.http.post("/v1/decisions", json={**body, "questions": [{"question": "q", "options": ["two tokens"]}]}), 400)
    _error(served.http.post("/v1/decisions", json={**body, "questions": questions * 3}), 400)
    _error(served.http.post("/v1/decisions", json={**body, "joint": False, "distinct": True}), 400)


def test_the_api_key_is_required(served):
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=served.url + "/v1", api_key=key or "x", max_retries=0,
                          default_headers={} if key else {"Authorization": ""}).models.list()
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    assert httpx2.post(served.url + "/v1/chat/completions", json={"model": NAME, "messages": USER}).status_code == 401


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_limits_and_bad_input_answer_4xx_in_openai_shape(served):
    post = served.http.post
    chat = lambda **extra: {"model": NAME, "messages": USER, **extra}
    assert _error(post("/v1/chat/completions", json=chat(model="nope")), 404)["code"] == "model_not_found"
    assert _error(post("/v1/chat/completions", json=chat(max_tokens=5000)), 400)["param"] == "max_tokens"
    assert _error(post("/v1/completions", json={"model": NAME, "prompt": "x " * 600}), 400)["code"] == "context_length_exceeded"
    assert _error(post("/v1/completions", json={"model": NAME, "prompt": "y" * 40000}), 413)["code"] == "request_too_large"
    chunked = post("/v1/completions", content=iter([b'{"prompt": "', b"z" * 40000, b'"}']), headers={"Content-Type": "application/json"})
    _error(chunked, 413)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}
    assert _error(post("/v1/chat/completions", json=chat(response_format=bad_schema)), 400)["code"] == "invalid_schema"
    unsupported = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    assert "uniqueItems" in _error(post("/v1/chat/completions", json=chat(response_format=unsupported)), 400)["message"]
    overlapping = {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"type": "object"}]}
    refused = _error(post("/v1/chat/completions", json=chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": overlapping}})), 400)
    assert "oneOf" in refused["message"] and "anyOf" in refused["message"]
    _error(post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    _error(post("/v1/chat/completions", json=[1, 2]), 400)
    _error(post("/v1/chat/completions", json=chat(temperature="hot")), 400)
    _error(post("/v1/chat/completions", json=chat(messages=[])), 400)
    _error(post("/v1/chat/completions", json=chat(n=9)), 400)
    _error(post("/v1/chat/completions", json=chat(block_size=4096)), 400)
    _error(post("/v1/chat/completions", json=chat(block_size="auto")), 400)
    _error(post("/v1/chat/completions", json=chat(logprobs=True)), 400)
    _error(post("/v1/chat/completions", json=chat(tool_choice="required")), 400)
    _error(post("/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})), 400)
    _error(post("/v1/completions", json={"model": NAME, "prompt": "[MASK] hello"}), 400)
    _error(post("/v1/completions", json={"model": NAME, "prompt": [999999]}), 400)
    _error(post("/v1/completions", json={"model": NAME, "prompt": ""}), 400)
    _error(post("/v1/completions", content=b'{"model": "x", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                headers={"Content-Type": "application/json"}), 400)
    assert _error(served.http.get("/v1/nothing"), 404)["code"] == "not_found"
    _error(served.http.get("/v1/chat/completions"), 405)
    worker = served.app.state.server.worker
    assert not worker.reserve(10**6, 256) and worker.reserve(0, 256)  # past max_pending: 429, nothing taken
    assert httpx2.get(served.url + "/health").status_code == 200  # still serving


def _soon(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_client_that_disconnects_frees_its_slot(served):
    engine = served.app.state.server.worker.engine
    slow = {"model": NAME, "messages": USER, "max_tokens": 1000, "block_size": 1}
    with served.http.stream("POST", "/v1/chat/completions", json={**slow, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert _soon(lambda: engine.rows, timeout=10)  # generating
    assert _soon(lambda: not engine.rows and not engine.waiting, timeout=2)
    # the same for a whole (non-streamed) answer: a raw connection that is closed while waiting
    body = json.dumps(slow).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert _soon(lambda: engine.rows, timeout=10)
    assert _soon(lambda: not engine.rows and not engine.waiting, timeout=2)
    assert "clover_cancelled_total 2.0" in httpx2.get(served.url + "/metrics").text


def _concurrent(served, clients: int, requests_each: int) -> dict:
    """clients threads x requests_each chat requests (half json_schema); every answer must be valid."""
    latencies, failures = [], []
    response_format = {"type": "json_schema", "json_schema": {"name": "zones", "schema": SCHEMA}}

    def client(k):
        oai = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        for r in range(requests_each):
            started = time.perf_counter()
            try:
                structured = (k + r) % 2 == 0
                result = oai.chat.completions.create(model=NAME, messages=USER, max_tokens=24 if not structured else 80,
                                                     response_format=response_format if structured else None,
                                                     extra_body={"block_size": 4})
                content = result.choices[0].message.content
                if structured:
                    jsonschema.validate(json.loads(content), SCHEMA)
                assert result.usage.completion_tokens > 0
                latencies.append(time.perf_counter() - started)
            except Exception as error:  # collected: the test reports every failure
                failures.append(repr(error))

    wall = concurrently(client, clients)
    assert not failures, failures[:3]
    latencies.sort()
    return {"requests": len(latencies), "wall_s": wall, "p50_s": latencies[len(latencies) // 2],
            "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]}


def test_concurrent_clients_lose_nothing(served):
    report = _concurrent(served, clients=6, requests_each=2)
    assert report["requests"] == 12


@pytest.mark.slow
def test_load_32_clients_x_10_requests(served):
    """The bench entry's load test: nothing lost, every answer valid (schema-valid JSON where asked)."""
    report = bench_load(served.model, served.tokenizer, clients=32, requests=10)
    assert report["concurrent"]["ok"] == 320 and report["concurrent"]["failed"] == 0
    assert report["single"]["failed"] == 0
    print(json.dumps(report, indent=1))


def test_serve_builds_the_app_from_its_command_line(tmp_path, monkeypatch, capsys):
    import uvicorn

    ran = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port: ran.update(app=app, host=host, port=port))
    model, tokenizer, _ = _start()
    save_model(model, tokenizer, tmp_path / "my-model")
    main(["serve", "--model", str(tmp_path / "my-model"), "--api-key", "k", "--max-tokens", "64", "--block-size", "8",
          "--threshold", "0.5"])  # fmt: skip
    assert (ran["host"], ran["port"]) == ("127.0.0.1", 8000)  # loopback unless asked
    assert ran["app"].state.server.config == ServerConfig(model_name="my-model", api_key="k", max_tokens=64, block_size=8, threshold=0.5)
    torch.manual_seed(0)
    save_peer(build_peer(peer_config(model.config)), tokenizer, tmp_path / "peer")
    with pytest.raises(SystemExit) as raised:
        main(["serve", "--model", str(tmp_path / "peer")])
    assert raised.value.code == 2 and capsys.readouterr().err == (
        f"error: clover serve serves Clover models only; {tmp_path / 'peer'} holds the autoregressive peer\n"
    )


# -- schemathesis: generated bad (and good) input against the OpenAPI document; nothing may answer 5xx --


@pytest.fixture(scope="module")
def fuzzed():
    # small limits keep the generated valid requests cheap
    _, _, app = _start(api_key=None, max_tokens=4, max_prompt_tokens=64, max_n=2, max_body_bytes=8 * 1024)
    with background_server(app) as url:
        yield url


@pytest.mark.parametrize("examples", [pytest.param(30, marks=pytest.mark.slow), 3])  # 3: a quick look in the default run
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/decisions"])
def test_no_input_makes_the_server_fail(fuzzed, path, mode, examples):
    operation = schemathesis.openapi.from_url(fuzzed + "/openapi.json")[path]["POST"]

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy(mode))
    def check(case):
        if isinstance(case.body, dict):  # the served model, so that generated bodies get past the 404
            case.body["model"] = NAME
        case.call_and_validate(base_url=fuzzed, checks=[not_a_server_error], timeout=60)

    check()
