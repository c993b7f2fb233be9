import json

import pytest

from cloverlm.tokenizer import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    MASK_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOLS_END,
    TOOLS_START,
    digit_groups,
    format_chat,
    load_tokenizer,
    same_tokenizer,
    train_tokenizer,
)
from cloverlm.training.scratch.corpus import read_source, stdlib_files, stdlib_root


@pytest.fixture(scope="session")
def all_files():
    return stdlib_files("train"), stdlib_files("val")


@pytest.fixture(scope="session")
def tok(all_files):
    train, _ = all_files
    texts = [t for t in map(read_source, train[::2][:300]) if t]
    return train_tokenizer(texts, vocab_size=2048)


# ---------------------------------------------------------------- corpus


def test_stdlib_files_splits(all_files):
    train, val = all_files
    assert train and val
    assert not set(train) & set(val)
    root = stdlib_root()
    for path in train + val:
        assert path.suffix == ".py"
        parts = path.relative_to(root).parts
        assert "site-packages" not in parts and "dist-packages" not in parts
    test_dirs = {"test", "tests", "idle_test"}
    assert all(not test_dirs & set(p.relative_to(root).parts[:-1]) for p in train)
    assert all(test_dirs & set(p.relative_to(root).parts[:-1]) for p in val)
    assert train == sorted(train) and val == sorted(val)


def test_stdlib_files_bad_split():
    with pytest.raises(ValueError, match="unknown split 'test'"):
        stdlib_files("test")


def test_read_source(tmp_path):
    good = tmp_path / "good.py"
    good.write_bytes("x = 'é'\r\n".encode())
    assert read_source(good) == "x = 'é'\r\n"  # exact bytes: no newline translation
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"x = '\xff\xfe'\n")
    assert read_source(bad) is None


# ---------------------------------------------------------------- tokenizer


def test_special_tokens_fixed_ids(tok):
    assert SPECIAL_TOKENS[:3] == (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(name) == i
        assert tok.encode(name) == [i]
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2)
    assert len(tok) == 2048


def test_special_tokens_in_text(tok):
    ids = tok.encode("a [MASK] b<|im_start|>user")
    assert ids.count(tok.mask_token_id) == 1
    assert ids.count(SPECIAL_TOKENS.index(IM_START)) == 1
    assert tok.decode(ids) == "a [MASK] b<|im_start|>user"


def test_numbers_are_cut_into_three_digit_groups(tok):
    pieces = [tok.decode([i]) for i in tok.encode("x = 1234567 + 42.5e10, id 007")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["123", "456", "7", "42", "5", "10", "007"]


def test_every_digit_group_is_one_token(tok):
    groups = digit_groups()
    assert len(groups) == 1110 and len(set(groups)) == 1110
    assert all(len(tok.encode(g)) == 1 for g in groups)


def test_too_small_vocab_for_digit_groups_is_refused():
    with pytest.raises(ValueError, match="vocab_size must be at least 1365 .* got 1364"):
        train_tokenizer(["def f(x):\n    return x\n"], vocab_size=1364)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "  leading and trailing  ",
        "\r\n\t\x00\x7f",
        "héllo wörld 😀 中文 \u200b \ufeff",
        "def f(x):\n    return x ** 2  # comment\n",
        "[MASK][MASK]<|endoftext|><|pad|>",
        "don't  can't .  ,",
    ],
)
def test_round_trip_strings(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_sample(tok, all_files):
    train, val = all_files
    texts = [t for t in map(read_source, train[1::40] + val[::40]) if t is not None]
    ids = tok(texts)["input_ids"]
    assert tok.batch_decode(ids) == texts


@pytest.mark.slow  # the fast check is test_round_trip_sample
def test_round_trip_every_stdlib_file(tok, all_files):
    train, val = all_files
    files = train + val
    sources = [read_source(f) for f in files]
    pairs = [(f, t) for f, t in zip(files, sources) if t is not None]
    assert len(pairs) > 0.99 * len(files)
    texts = [t for _, t in pairs]
    decoded = tok.batch_decode(tok(texts)["input_ids"])
    bad = [str(f) for (f, t), d in zip(pairs, decoded) if t != d]
    assert not bad, bad[:5]


def test_save_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert (tmp_path / "chat_template.jinja").is_file()
    loaded = load_tokenizer(tmp_path)
    text = "class A:\n    x = 123  # [MASK] <tool_call>\n"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.chat_template == tok.chat_template
    assert (loaded.eos_token, loaded.pad_token, loaded.mask_token) == (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
    assert loaded.clean_up_tokenization_spaces is False
    assert loaded.decode(loaded.encode("a  b ,")) == "a  b ,"


def test_same_tokenizer_sees_every_difference_that_changes_ids(tmp_path):
    """A saved and reloaded tokenizer (and one a padded call has touched) is the same; another vocabulary,
    an added token, another special-token role or another chat template is not."""
    import copy

    scratch = load_tokenizer("models/scratch-tokenizer")
    scratch.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    reloaded(["a", "a b c"], padding=True, truncation=True, max_length=2)
    assert same_tokenizer(scratch, reloaded)
    added, role, template = copy.deepcopy(scratch), copy.deepcopy(scratch), copy.deepcopy(scratch)
    added.add_tokens(["<extra>"])
    role.pad_token = EOS_TOKEN
    template.chat_template = scratch.chat_template.replace("<|im_start|>", "<|im_start|> ")
    small = train_tokenizer(["some text 12"] * 3, vocab_size=1500)
    for other in (added, role, template, small):
        assert not same_tokenizer(scratch, other) and not same_tokenizer(other, scratch)


def test_load_missing(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer in .*: expected tokenizer.json"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- chat template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "Current time.", "parameters": {}}},
]


def test_chat_template_with_tools(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                {"name": "now", "arguments": "{}"},
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\n"
        "Be brief.\n\n"
        "You can call these tools. Return each call as JSON inside <tool_call></tool_call> tags.\n"
        "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\nLet me add.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n5<|im_end|>\n"
        "<|im_start|>tool\n12:00<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    ids = tok.encode(text)
    for name in (IM_START, IM_END, TOOLS_START, TOOLS_END, TOOL_CALL_START, TOOL_CALL_END):
        assert SPECIAL_TOKENS.index(name) in ids
    assert tok.decode(ids) == text


def test_chat_template_plain(tok):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": "é"}}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call><|im_end|>\n'
    )


def test_format_chat(tok):
    prompt, answer = format_chat(tok, "2+2?", "4")
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert answer == "4<|im_end|>"
    full = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tokenize=False
    )
    assert prompt + answer + "\n" == full
    assert format_chat(tok, "2+2?") == (prompt, "")

    prompt, answer = format_chat(tok, "add", "ok", tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou can call these tools.")
    assert json.dumps(TOOLS[1]) + "\n</tools><|im_end|>\n<|im_start|>user\nadd<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert answer == "ok<|im_end|>"


def test_stop_strings_keep_the_fewest_tokens_and_cut_the_text_exactly(tok):
    from cloverlm.tokenizer import StopStrings

    text = "alpha beta\n\nGAMMA delta"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stop = StopStrings(tok, ["\n\n", "delta", ""])
    keep = stop(ids)
    kept_text = tok.decode(ids[:keep])
    assert "\n\n" in kept_text and stop.find(tok.decode(ids[: keep - 1])) is None
    assert stop.cut(kept_text) == stop.cut(text) == "alpha beta"
    assert stop(tok("no stop here", add_special_tokens=False)["input_ids"]) is None
    assert StopStrings(tok, ["ta"]).cut(text) == "alpha be"
    # a stop string that begins inside a token: the kept tokens still hold all of it, so the cut finds it
    pieces = [tok.decode([i]) for i in ids]
    first = next(k for k, piece in enumerate(pieces) if len(piece) >= 2)
    start = len("".join(pieces[: first + 1])) - 1  # the last character of a multi-character token
    inside = StopStrings(tok, [text[start : start + 2]])
    assert text.find(text[start : start + 2]) == start
    assert inside.cut(tok.decode(ids[: inside(ids)])) == text[:start]
