"""Serving benches (sections of `clover bench`): structured output and many clients at once.

* `structured` (bench_structured): held-out tool_call prompts decoded twice at the same block size and
  threshold, free and under the tool-call grammar of the offered tools (`tool_choice="required"`):
  tokens per forward (TPF), the share of outputs that are a valid call of an offered tool (arguments
  valid against its schema), task accuracy, and wall time. Forced tokens cost no forward, so TPF under
  the grammar can beat free decoding although only a left-to-right run may commit per step.
* `serving` (bench_load): one `clover serve` app on a free loopback port; first one client, then
  `clients` concurrent clients, each sending `requests` chat requests in turn (every other one with a
  json_schema response format). Every response must be a 200 whose content is valid (schema-valid JSON
  where asked); lost and invalid responses are counted. Throughput in requests/s and generated
  tokens/s, latency p50 / p99 per request.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import jsonschema

from cloverlm import tasks
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.evaluation.heldout import answer_budget, heldout_examples
from cloverlm.serving.app import create_app
from cloverlm.serving.background import background_server
from cloverlm.serving.schemas import ServerConfig
from cloverlm.serving.text import parse_tool_calls
from cloverlm.tokenizer import stop_token_ids

LOAD_SCHEMA = {
    "type": "object",
    "properties": {
        "zone": {"enum": ["A", "B", "C", "D"]},
        "drones": {"type": "array", "maxItems": 4, "items": {"type": "integer", "minimum": 1, "maximum": 8}},
    },
    "required": ["zone", "drones"],
    "additionalProperties": False,
}


def _valid_call(text: str, offered: tuple[dict, ...]) -> bool:
    _, calls = parse_tool_calls(text)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in offered}
    if len(calls) != 1 or calls[0]["function"]["name"] not in schemas:
        return False
    try:
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schemas[calls[0]["function"]["name"]])
    except jsonschema.ValidationError:
        return False
    return True


def bench_structured(model, tokenizer, prompts: int, block_size: int, threshold: float) -> dict:
    """{"free": {...}, "grammar": {...}} for the tool_call task; fields in the module docstring."""
    examples = heldout_examples(tokenizer, "tool_call", prompts, 1 << 30)
    grammars = Grammars(tokenizer, model.config.vocab_size, stop_token_ids(tokenizer))
    task = tasks.get_task("tool_call")
    report = {}
    for mode in ("free", "grammar"):
        engine = Engine(model, max_batch_size=1)
        tokens = forwards = valid = 0
        scores, started = [], time.perf_counter()
        for encoded in examples:
            offered = encoded.example.tools
            constraint = None
            if mode == "grammar":
                functions = [(t["function"]["name"], t["function"]["parameters"]) for t in offered]
                constraint = grammars.constraint(grammars.tool_calls(functions, single=True))
            params = DecodeParams(
                max_new_tokens=answer_budget(encoded), block_size=block_size,
                threshold=threshold, stop_token_ids=stop_token_ids(tokenizer),
            )
            [completion] = engine.generate([Request(encoded.ids[: encoded.prompt_length], params, constraint=constraint)])
            text = tokenizer.decode(completion.tokens)
            tokens, forwards = tokens + len(completion.tokens), forwards + completion.forwards
            valid += _valid_call(text, offered)
            scores.append(task.check(encoded.example, text)["exact"])
        report[mode] = {
            "tpf": round(tokens / max(forwards, 1), 3),
            "valid_calls": round(valid / len(examples), 4),
            "accuracy": round(statistics.mean(scores), 4),
            "wall_s": round(time.perf_counter() - started, 3),
        }
    report["prompts"], report["block_size"], report["threshold"] = len(examples), block_size, threshold
    return report


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=ServerConfig.request_timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {}


def concurrently(client, clients: int) -> float:
    """Run client(k) for k < clients, each in its own thread, at once; the wall seconds until all end."""
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _run_clients(url: str, model_name: str, clients: int, requests: int, max_tokens: int, block_size: int) -> dict:
    latencies: list[float] = []
    generated = [0]
    problems: list[str] = []
    lock = threading.Lock()
    response_format = {"type": "json_schema", "json_schema": {"name": "zones", "schema": LOAD_SCHEMA}}

    def client(k: int) -> None:
        for r in range(requests):
            structured = (k + r) % 2 == 0
            body: dict[str, Any] = {
                "model": model_name, "max_tokens": max_tokens, "block_size": block_size,
                "messages": [{"role": "user", "content": f"Client {k}, request {r}: which zone is free for drones?"}],
            }
            if structured:
                body["response_format"] = response_format
            started = time.perf_counter()
            try:
                status, answer = _post(url + "/v1/chat/completions", body)
            except OSError as error:  # connection refused, reset, timed out: a lost request
                status, answer = 0, {"error": repr(error)}
            latency = time.perf_counter() - started
            problem = None
            if status != 200:
                problem = f"status {status}"
            elif structured:
                try:
                    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), LOAD_SCHEMA)
                except (ValueError, jsonschema.ValidationError) as error:
                    problem = f"invalid JSON: {error}"
            with lock:
                if problem:
                    problems.append(problem)
                else:
                    latencies.append(latency)
                    generated[0] += answer["usage"]["completion_tokens"]

    wall = concurrently(client, clients)
    return {
        "clients": clients, "requests": clients * requests, "ok": len(latencies), "failed": len(problems),
        "first_problems": problems[:3], "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 3), "tokens_per_s": round(generated[0] / wall, 2),
        "latency_p50_s": round(_percentile(latencies, 0.5), 4) if latencies else None,
        "latency_p99_s": round(_percentile(latencies, 0.99), 4) if latencies else None,
    }


def bench_load(model, tokenizer, clients: int, requests: int, max_tokens: int = 64,
               block_size: int = DecodeParams.block_size, max_batch_size: int = 32, threshold: float = DecodeParams.threshold) -> dict:
    """{"single": one client, "concurrent": `clients` at once}, each sending `requests` in turn."""
    name = "clover-bench"
    app = create_app(model, tokenizer, ServerConfig(model_name=name, max_batch_size=max_batch_size, threshold=threshold))
    with background_server(app) as url:
        _run_clients(url, name, 1, 1, max_tokens, block_size)  # warm-up
        single = _run_clients(url, name, 1, requests, max_tokens, block_size)
        concurrent = _run_clients(url, name, clients, requests, max_tokens, block_size)
    return {"single": single, "concurrent": concurrent, "max_tokens": max_tokens, "block_size": block_size,
            "threshold": threshold, "max_batch_size": max_batch_size}
