"""`clover serve` under hostile input (issue 22): every request ends, and no input gives a 500.

Lone surrogates, malformed JSON, impossible decisions, tool schemas under auto, unparseable tool calls,
prompt + max_tokens past the context, the per-request time limit and the bounded queue. The fuzz of
every endpoint is tests/test_server_fuzz.py."""

import asyncio
import json
import logging
import threading
import time
from contextlib import contextmanager
from logging.handlers import BufferingHandler
from types import SimpleNamespace

import httpx2
import pytest
import torch

from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import Completion, DecodeParams, Request
from cloverlm.serving.app import create_app
from cloverlm.serving.background import background_server
from cloverlm.serving.planning import Plan
from cloverlm.serving.responses import ChatFormat
from cloverlm.serving.schemas import ServerConfig
from cloverlm.serving.worker import DoneEvent, EngineWorker, FailedEvent, Job, Metrics
from cloverlm.tokenizer import load_tokenizer
from conftest import tiny_model

NAME = "clover-test"
CONTEXT = 300  # the tiny model's context: prompt + max_tokens must fit
USER = [{"role": "user", "content": "Which zone is free?"}]
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}
YES_NO = [{"question": f"q{i}", "options": ["yes", "no"]} for i in (1, 2, 3)]


def _serve(context: int = CONTEXT, **overrides):
    torch.set_num_threads(1)
    tokenizer = load_tokenizer("models/scratch-tokenizer")
    model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=context)
    config = ServerConfig(**{"model_name": NAME, "max_prompt_tokens": 512, "max_tokens": 1024, "default_max_tokens": 16,
                             "max_body_bytes": 32 * 1024, **overrides})
    return model, tokenizer, create_app(model, tokenizer, config)


@contextmanager
def running_server(**overrides):
    """A live server; `errors` collects its error logs (an unhandled error, a 500, logs one)."""
    _, tokenizer, app = _serve(**overrides)
    errors, logger = BufferingHandler(10**6), logging.getLogger("cloverlm.serving")  # app and worker log under it
    errors.setLevel(logging.ERROR)
    logger.addHandler(errors)
    try:
        with background_server(app) as url, httpx2.Client(base_url=url, timeout=60) as http:
            yield SimpleNamespace(url=url, app=app, tokenizer=tokenizer, http=http, errors=errors.buffer)
    finally:
        logger.removeHandler(errors)


@pytest.fixture(scope="module")
def served():
    with running_server() as server:
        yield server


def _post(served, path: str, raw: str):
    """POST a JSON text as given (json.dumps escapes a lone surrogate as \\ud800, as a client would);
    returns (response, seconds)."""
    started = time.perf_counter()
    response = served.http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
    return response, time.perf_counter() - started


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


SURROGATES = [  # issue 22: each gave 500 with a traceback (TypeError in the tokenizer, or json.dumps of the schema)
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi \ud800 x"}], "max_tokens": 8},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text"),
    ("/v1/completions", {"model": NAME, "prompt": "hi \ud800 x", "max_tokens": 8}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ["ok", "\ud800"]}, "prompt.1"),
    ("/v1/decisions", {"model": NAME, "context": "\ud800", "questions": YES_NO[:1]}, "context"),
    ("/v1/decisions", {"model": NAME, "questions": [{"question": "q", "options": ["yes", "\ud800"]}]}, "questions.0.options.1"),
    ("/v1/chat/completions", {"model": NAME, "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "description": "\ud800"}}]}, "tools.0.function.description"),
    ("/v1/chat/completions", {"model": NAME, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["\ud800"]}}}}, "response_format.json_schema.schema.enum.0"),
    ("/v1/chat/completions", {"model": NAME, "messages": USER, "user": "\ud800"}, "user"),  # an ignored field too
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES, ids=[s[2] for s in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_the_field(served, path, body, param):
    response, seconds = _post(served, path, json.dumps(body))
    error = _error(response, 400)
    assert (error["param"], error["code"]) == (param, "invalid_unicode") and seconds < 1
    assert error["message"] == f"{param} holds a lone UTF-16 surrogate; text must be valid Unicode"
    assert not served.errors
    # a valid pair is one character (U+1F600), not a surrogate: accepted
    fine, _ = _post(served, "/v1/completions", json.dumps({"model": NAME, "prompt": "hi \U0001f600", "max_tokens": 2}))
    assert fine.status_code == 200, fine.text


def test_malformed_json_names_the_field_not_the_offset(served):
    body = '{"model":"' + NAME + '","messages":[{"role":"user","content":"hi"}],"max_tokens":x}'
    error = _error(_post(served, "/v1/chat/completions", body)[0], 400)
    assert (error["param"], error["code"]) == ("max_tokens", "invalid_json")  # was "70", the character offset
    assert error["message"] == f"the body is not valid JSON: Expecting value at character {body.index('x}')}, in max_tokens"
    body = '{"model":"' + NAME + '","messages":[{"role":"user","content":"bad \\x escape"}]}'
    assert _error(_post(served, "/v1/chat/completions", body)[0], 400)["param"] == "messages.0.content"
    assert _error(_post(served, "/v1/completions", "{not json")[0], 400)["param"] is None  # no field yet


def test_impossible_distinct_decisions_are_refused_at_once(served):
    # issue 22: no answer after 120 s (the engine kept decoding it); now a 400 before decoding
    response, seconds = _post(served, "/v1/decisions", json.dumps({"model": NAME, "questions": YES_NO, "distinct": True,
                                                                   "max_steps": 4}))
    error = _error(response, 400)
    assert error["param"] == "questions" and seconds < 1
    assert error["message"] == "distinct answers are impossible: questions 1, 2, 3 have only 2 different options between them (no, yes)"
    possible, _ = _post(served, "/v1/decisions", json.dumps({"model": NAME, "questions": YES_NO[:2], "distinct": True}))
    assert possible.status_code == 200 and {a["answer"] for a in possible.json()["answers"]} == {"yes", "no"}
    assert possible.json()["usage"]["forwards"] <= 2  # at most one forward per question
    # the block_size error names block_size (it named "questions")
    error = _error(_post(served, "/v1/decisions", json.dumps({"model": NAME, "questions": YES_NO[:1], "block_size": 4096}))[0], 400)
    assert error["param"] == "block_size" and error["message"] == "block_size is 4096; this model's blocks hold 1..64 tokens"


def test_auto_checks_tool_schemas_as_required_does(served):
    errors = []
    for choice in ("auto", "required"):  # auto accepted the bad schema (200)
        body = {"model": NAME, "messages": USER, "max_tokens": 4, "tools": [BAD_TOOL], "tool_choice": choice}
        errors.append(_error(_post(served, "/v1/chat/completions", json.dumps(body))[0], 400))
    assert errors[0] == errors[1] and (errors[0]["param"], errors[0]["code"]) == ("tools", "invalid_schema")
    assert errors[0]["message"].startswith("invalid JSON schema: 7 is not valid")


def test_an_unparseable_tool_call_is_reported_not_returned_as_content(served):
    server = served.app.state.server
    plan = Plan([[5]], DecodeParams(), 1, None, None, frozenset({"get_weather"}), False, False)
    cases = [
        ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', "the tool call is not a JSON object with a \"name\""),
        ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', "no tool is named 'launch'"),
    ]
    for text, message in cases:
        tokens = served.tokenizer.encode(text, add_special_tokens=False)
        choice = ChatFormat(server, plan).whole_choice(0, Completion(None, tokens, "stop", 1, 1, 1, 1))
        assert choice["finish_reason"] == "tool_call_error" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == ("Let me look." if text.startswith("Let") else None)
        [invalid] = choice["message"]["invalid_tool_calls"]
        assert invalid["error"] == message and invalid["text"] == text.split("<tool_call>")[1].split("</tool_call>")[0].strip()
        streamed = ChatFormat(server, plan)
        streamed.texts[0].push(tokens)
        final = streamed.final_choice(0, Completion(None, tokens, "stop", 1, 1, 1, 1))
        assert final["finish_reason"] == "tool_call_error" and final["delta"]["invalid_tool_calls"] == [invalid]
    good = served.tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                                   add_special_tokens=False)
    choice = ChatFormat(server, plan).whole_choice(0, Completion(None, good, "stop", 1, 1, 1, 1))
    assert choice["finish_reason"] == "tool_calls" and "invalid_tool_calls" not in choice["message"]


def test_prompt_plus_max_tokens_must_fit_the_context(served):
    error = _error(_post(served, "/v1/completions", json.dumps({"model": NAME, "prompt": [7] * 250, "max_tokens": 100}))[0], 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")  # was accepted
    assert error["message"] == ("this model's context is 300 tokens; the request needs 350 (250 in the prompt, 100 to generate): "
                                "shorten the prompt or ask for fewer tokens")
    chat = {"model": NAME, "messages": [{"role": "user", "content": "go " * 240}], "max_tokens": 200}
    assert _error(_post(served, "/v1/chat/completions", json.dumps(chat))[0], 400)["param"] == "messages"
    # without max_tokens the default (16) is cut to what the context leaves
    fits, _ = _post(served, "/v1/completions", json.dumps({"model": NAME, "prompt": [7] * 290}))
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] <= 10


# -- every request ends: the per-request time limit and the bounded queue --


TIMEOUT = 2.0


@pytest.fixture(scope="module")
def crowded():
    """Two batch slots, six generations in flight at most, a 2 s time limit."""
    with running_server(context=65536, max_batch_size=2, max_pending=6, max_tokens=50000, request_timeout_s=TIMEOUT) as server:
        yield server


SLOW = {"model": NAME, "messages": USER, "max_tokens": 50000, "block_size": 1}  # far longer than the time limit


def _slow_stream(url: str, out: list):
    started = time.perf_counter()
    with httpx2.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={**SLOW, "stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    out.append((response.status_code, chunks, time.perf_counter() - started))


def _threads(target, args_list):
    threads = [threading.Thread(target=target, args=args) for args in args_list]
    for thread in threads:
        thread.start()
    return threads


def _soon(condition, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_full_queue_answers_429_and_every_slow_request_ends(crowded):
    streams, queued = [], []
    worker = crowded.app.state.server.worker
    engine = worker.engine
    threads = _threads(_slow_stream, [(crowded.url, streams)] * 2)
    assert _soon(lambda: len(engine.rows) == 2)  # both slots taken

    def whole(out):
        started = time.perf_counter()
        response = httpx2.post(crowded.url + "/v1/chat/completions", json=SLOW, timeout=60)
        out.append((response, time.perf_counter() - started))

    threads += _threads(whole, [(queued,)] * 4)
    assert _soon(lambda: worker._load == 6) and len(engine.rows) == 2  # the queue is full: 2 running + 4 waiting
    # a request that waited for a slot would get one (2 tokens: a 200); the 429 says it was refused as it came
    refused = httpx2.post(crowded.url + "/v1/chat/completions", json={**SLOW, "max_tokens": 2}, timeout=60)
    error = _error(refused, 429)
    assert (error["code"], error["type"]) == ("server_busy", "rate_limit_error")
    for thread in threads:
        thread.join(timeout=30)
    for status, chunks, seconds in streams:  # each slow stream ends at the time limit, with what it produced
        assert status == 200 and chunks[-1]["choices"][0]["finish_reason"] == "time_limit" and seconds < TIMEOUT + 1.5
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    for response, seconds in queued:  # queued behind them: a slot at the time limit, or 429 if none came free in time
        assert seconds < 2 * TIMEOUT + 1.5
        if response.status_code == 200:
            assert response.json()["choices"][0]["finish_reason"] == "time_limit"
        else:
            assert _error(response, 429)["code"] == "server_busy"
    assert not engine.rows and not engine.waiting


def test_normal_requests_are_answered_while_a_slow_one_is_in_flight(crowded):
    """The load test's point on a small scale: a request far longer than the time limit holds one of
    the two slots; four clients x two requests go through the other, none lost, none cut."""
    streams, answers = [], []
    threads = _threads(_slow_stream, [(crowded.url, streams)])
    time.sleep(0.3)

    def client(out):
        with httpx2.Client(base_url=crowded.url, timeout=60) as http:
            for _ in range(2):
                out.append(http.post("/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 8,
                                                                   "block_size": 4}))

    threads += _threads(client, [(answers,)] * 4)
    for thread in threads:
        thread.join(timeout=60)
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
    assert {r.json()["choices"][0]["finish_reason"] for r in answers} <= {"length", "stop"}
    [(status, chunks, seconds)] = streams
    assert status == 200 and chunks[-1]["choices"][0]["finish_reason"] == "time_limit"


def test_a_request_that_never_gets_a_slot_in_time_is_a_429():
    """A time limit of 0: every job is past its deadline before its first forward."""
    with running_server(request_timeout_s=0) as server:
        http = server.http
        for path, body in (("/v1/chat/completions", {"model": NAME, "messages": USER}),
                           ("/v1/decisions", {"model": NAME, "questions": YES_NO[:2]})):
            error = _error(http.post(path, json=body), 429)
            assert error["code"] == "server_busy" and error["message"] == (
                "no batch slot came free within the server's time limit of 0 s; retry later")
        with http.stream("POST", "/v1/completions", json={"model": NAME, "prompt": "hi", "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "server_busy" and events[-1] == "data: [DONE]"
        assert not server.app.state.server.worker.engine.has_work()


def test_the_worker_ends_jobs_past_their_deadline():
    """A job past its deadline: its choices end with finish_reason "time_limit" and what they produced;
    a job none of whose choices got a batch slot answers 429."""
    loop = asyncio.new_event_loop()
    worker = EngineWorker(Engine(tiny_model(), max_batch_size=1), Metrics())  # stepped here, no thread
    params = DecodeParams(max_new_tokens=50, block_size=1)
    started, waiting = Job(loop, timeout_s=60), Job(loop, timeout_s=60)
    started.requests = [Request([5, 6], params, request_id=(started, i)) for i in range(2)]
    waiting.requests = [Request([5, 6], params, request_id=(waiting, 0))]
    for job in (started, waiting):
        assert worker.reserve(len(job.requests), 10)
        worker._submit(job)
    worker._step()
    worker._step()  # choice 0 of `started` holds the one slot: two forwards; the rest wait
    worker._expire(time.monotonic())
    assert worker.engine.has_work()  # not yet due
    worker._expire(time.monotonic() + 61)
    assert not worker.engine.has_work() and worker._load == 0 and worker.metrics.timed_out._value.get() == 3
    loop.run_until_complete(asyncio.sleep(0))  # deliver the posted events
    events = [started.events.get_nowait() for _ in range(2)]
    assert all(isinstance(e, DoneEvent) and e.completion.finish_reason == "time_limit" for e in events)
    assert [e.completion.forwards for e in events] == [2, 0] and len(events[0].completion.tokens) == 2
    failed = waiting.events.get_nowait()
    assert isinstance(failed, FailedEvent) and (failed.status, failed.code) == (429, "server_busy")
    assert "within the server's time limit of 60 s" in failed.message
    loop.close()
