"""`clover serve` under generated hostile input (issue 22, slow): a hypothesis fuzz of every endpoint,
with surrogates, control characters, special tokens and very long tokens in every string; nothing may
answer 5xx or log an error. The server is test_server_hostile.py's."""

import json
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server_hostile import NAME, running_server

# -- fuzzing: generated hostile strings in every field of every endpoint; nothing may answer 5xx --


CLEAN = st.text(st.one_of(st.characters(), st.characters(categories=["Cc"])), max_size=40)  # control characters too
TEXT = st.one_of(
    CLEAN, CLEAN, CLEAN, CLEAN, CLEAN, CLEAN,
    st.builds(lambda a, s, b: a + s + b, CLEAN, st.characters(categories=["Cs"]), CLEAN),  # a lone surrogate inside
    st.builds(lambda c, n: c * n, st.characters(), st.integers(100, 1500)),  # one very long token
    st.sampled_from(["<|im_start|>", "<|im_end|>", "[MASK]", "<tool_call>", "</tool_call>", "{{ x }}", "{% if %}", "\x00"]),
)


def mostly(valid, invalid):
    """Valid values most of the time, so that the hostile strings get past the field checks to the tokenizer,
    the chat template and the grammar compiler."""
    return st.one_of(valid, valid, valid, invalid)


BAD_INT = st.one_of(st.sampled_from([0, -1, 65, 2**31, 2**63]), st.none(), TEXT)
ANY = st.one_of(TEXT, BAD_INT, st.booleans(), st.floats(allow_nan=True), st.lists(TEXT, max_size=3))
SCHEMA = st.one_of(
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(TEXT, st.fixed_dictionaries(
        {"enum": st.lists(TEXT, min_size=1, max_size=3)}), max_size=2), "additionalProperties": st.just(False)}),
    st.fixed_dictionaries({"enum": st.lists(TEXT, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", 7, "nope"]), "pattern": TEXT}),
)
SAMPLING = {"max_tokens": mostly(st.integers(1, 4), BAD_INT), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5)),
            "n": mostly(st.integers(1, 2), BAD_INT), "stream": st.booleans(),
            "block_size": mostly(st.integers(1, 8), st.one_of(BAD_INT, st.just("auto"))),
            "max_steps": mostly(st.integers(1, 4), BAD_INT), "temperature": st.sampled_from([0, 1.0]),
            "seed": mostly(st.integers(0, 9), BAD_INT),
            "response_format": st.one_of(st.just({"type": "json_object"}), st.builds(
                lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, SCHEMA))}
TOOL = st.builds(lambda name, text, schema: {"type": "function", "function": {"name": name, "description": text,
                                                                                "parameters": schema}},
                 mostly(st.sampled_from(["get_weather", "set_timer"]), TEXT), TEXT, SCHEMA)
MESSAGE = st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT),
                                 "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                             "text": TEXT}), max_size=2))})
BODIES = {
    "/v1/completions": st.fixed_dictionaries({"prompt": mostly(st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2)),
                                                               st.lists(st.integers(-1, 9000), max_size=5))},
                                             optional=SAMPLING),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3)}, optional={
        **SAMPLING, "tools": st.lists(TOOL, max_size=2), "parallel_tool_calls": st.booleans(),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}])}),
    "/v1/decisions": st.fixed_dictionaries({"questions": st.lists(st.fixed_dictionaries(
        {"question": TEXT, "options": st.lists(mostly(st.sampled_from(["yes", "no", "1", "2", "A", "B"]), TEXT), min_size=1, max_size=4)}),
        min_size=1, max_size=9)}, optional={"context": TEXT, "joint": st.booleans(), "distinct": st.booleans(),
                                             "block_size": mostly(st.integers(1, 8), BAD_INT),
                                             "max_steps": mostly(st.integers(1, 4), BAD_INT)}),
}


def _without_surrogates(value):
    if isinstance(value, str):
        return re.sub("[\ud800-\udfff]", "?", value)
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    return value


@pytest.fixture(scope="module")
def fuzzed():
    with running_server(max_tokens=4, max_prompt_tokens=64, max_n=2, max_body_bytes=64 * 1024, request_timeout_s=10) as server:
        yield server


@pytest.mark.slow
def test_fuzzing_every_endpoint_gives_no_5xx(fuzzed):
    """300 generated requests (about 20 s on 2 cores): bodies shaped like each endpoint's, with
    surrogates, control characters, special tokens and very long tokens in every string, odd numbers
    everywhere, extra fields, invalid UTF-8. 0 x 5xx, and no error in the server's log."""
    statuses, codes = [], []

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(sorted(BODIES) * 6 + ["/v1/models", "/health", "/metrics"]), data=st.data(),
           extra=st.dictionaries(st.text(max_size=8), ANY, max_size=2), raw=st.sampled_from([None] * 8 + [b"\xff", b"\xed\xa0\x80"]))
    def check(path, data, extra, raw):
        if path not in BODIES:
            response = fuzzed.http.get(path)
        else:
            body = {"model": NAME, **extra, **data.draw(BODIES[path])}
            if data.draw(st.integers(0, 3)):  # 3 in 4 without surrogates, so that the rest of the text gets through
                body = _without_surrogates(body)
            content = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as \ud800
            if raw is not None:  # invalid UTF-8, or a surrogate encoded as UTF-8 bytes, in the body itself
                content = content.replace(b'"model"', b'"' + raw + b'":1,"model"', 1)
            with fuzzed.http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
                text = "".join(response.iter_text())
            assert "server_error" not in text, text[:300]  # also inside a stream, after the 200
        statuses.append(response.status_code)
        assert response.status_code < 500, response.text[:300] if path not in BODIES else text[:300]
        if 400 <= response.status_code and path in BODIES:
            codes.append(json.loads(text)["error"]["code"])

    check()
    print("statuses", Counter(statuses), "error codes", Counter(codes))  # with -s: what the fuzz reached
    assert not fuzzed.errors, [r.getMessage() for r in fuzzed.errors[:3]]
    assert statuses.count(200) >= 10  # some generated requests were valid and decoded
