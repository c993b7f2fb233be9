"""Byte-level BPE tokenizer, ChatML chat template, and reading JSON answers and tool calls out of model text.

Byte-level BPE over the full 256-byte alphabet, so ``decode(encode(text)) == text`` for every
string. Numbers are cut into groups of up to three digits from the left (as in Llama 3 and Qwen), and
every group from 0 to 999 is one token: with ten single-digit symbols a copying head cannot tell one
place in a digit string from another, with a thousand it can.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cloverlm.errors import CloverError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "[MASK]"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOLS_START = "<tools>"
TOOLS_END = "</tools>"

# Fixed order: the id of each token is its index here.
SPECIAL_TOKENS = (
    EOS_TOKEN,
    PAD_TOKEN,
    MASK_TOKEN,
    IM_START,
    IM_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOLS_START,
    TOOLS_END,
)

MODEL_MAX_LENGTH = 1 << 30


def chat_template() -> str:
    """The package's ChatML chat template (``chat_template.jinja``)."""
    return resources.files("cloverlm").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=chat_template(),
    )


def digit_groups() -> list[str]:
    """Every string of one to three digits ("0" ... "9", "00" ... "99", "000" ... "999")."""
    return [f"{n:0{width}d}" for width in (1, 2, 3) for n in range(10**width)]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``; the special tokens take ids 0..8 and every digit
    group of `digit_groups` is one token.

    BPE learns merges from the texts with the digits left out, and the 1,100 groups of two and three
    digits join the vocabulary as whole words (``ignore_merges``: a pre-token found in the vocabulary is
    one token). The pre-tokenizer isolates digit groups, so no merge ever spans a digit and a non-digit.
    """
    multi_digit = [g for g in digit_groups() if len(g) > 1]
    base = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < base + len(multi_digit):
        raise ValueError(f"vocab_size must be at least {base + len(multi_digit)} (bytes, special tokens and digit groups), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(multi_digit),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((re.sub(r"\d+", "", text) for text in texts), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for group in multi_digit:
        vocab[group] = len(vocab)
    spec["model"]["ignore_merges"] = True
    return _wrap(Tokenizer.from_str(json.dumps(spec)))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved with ``save_pretrained`` from the folder ``path``."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer in {path}: expected tokenizer.json")
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    if not tok.chat_template:
        tok.chat_template = chat_template()
    return tok


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids for every text and conversation: the same pipeline
    (normalizer, pre-tokenizer, vocabulary, merges, added tokens), special-token roles and chat template.
    The backends' padding and truncation settings are left out: calls change them, the ids do not."""

    def pipeline(tok) -> dict:
        spec = json.loads(tok.backend_tokenizer.to_str())
        return {k: v for k, v in spec.items() if k not in ("padding", "truncation")}

    return (
        pipeline(a) == pipeline(b)
        and a.special_tokens_map == b.special_tokens_map
        and (a.chat_template or chat_template()) == (b.chat_template or chat_template())
    )


def format_chat(
    tokenizer: PreTrainedTokenizerFast,
    prompt: str,
    answer: str | None = None,
    tools: Sequence[dict[str, Any]] = (),
) -> tuple[str, str]:
    """Render a one-turn conversation as ``(prompt_text, answer_text)``.

    ``prompt_text`` ends with the generation prompt ``<|im_start|>assistant\\n``;
    ``answer_text`` is ``answer + "<|im_end|>"`` (empty if ``answer`` is None). Training data
    concatenates the two and computes the loss on the answer part only.
    """
    prompt_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tools=list(tools) or None,
        add_generation_prompt=True,
        tokenize=False,
    )
    answer_text = "" if answer is None else answer + IM_END
    return prompt_text, answer_text


class StopStrings:
    """Stop strings for the token-level engine (`DecodeParams.stop`).

    Called with the generated token ids after each block, it returns how many tokens to keep once the
    decoded text contains a stop string: the fewest whose text holds a whole stop string (a stop string
    may begin inside a token, so covering only the text before it would lose it), else None. `cut`
    then trims the decoded text exactly at the first stop string.
    """

    def __init__(self, tokenizer, strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.strings = [s for s in strings if s]

    def find(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return min(hits) if hits else None

    def cut(self, text: str) -> str:
        index = self.find(text)
        return text if index is None else text[:index]

    def __call__(self, tokens: list[int]) -> int | None:
        if self.find(self.tokenizer.decode(tokens)) is None:
            return None
        low, high = 1, len(tokens)  # a prefix that holds a stop string stays one when it grows: bisect
        while low < high:
            middle = (low + high) // 2
            if self.find(self.tokenizer.decode(tokens[:middle])) is not None:
                high = middle
            else:
                low = middle + 1
        return low


# A one-turn conversation rendered to find the chat's control tokens; the reply is text no template
# writes by itself, so the text after its last occurrence is what closes the assistant turn.
_PROBE_REPLY = "Hello."
_PROBE = ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": _PROBE_REPLY})


def _chat_tokens(tokenizer) -> tuple[int, set[int]]:
    """(the end-of-turn id, every special token id the template writes in a conversation)."""
    # The package's template where the tokenizer has none, as load_tokenizer gives it.
    template = tokenizer.chat_template or chat_template()
    text = tokenizer.apply_chat_template(list(_PROBE), chat_template=template, tokenize=False, add_generation_prompt=True)
    special = tokenizer.added_tokens_decoder
    after = text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY) :] if _PROBE_REPLY in text else ""
    first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    # A token of the vocabulary's own (not ordinary text that happens to spell <|im_end|>) that the
    # template writes whole: a base without ChatML tokens would otherwise "end" turns on a '<' piece.
    if not first or first[0] not in special or not after.startswith(special[first[0]].content):
        raise CloverError(
            f"no end-of-turn token: the chat template does not close an assistant turn with a single special token "
            f"(a ChatML vocabulary has {IM_START} and {IM_END})"
        )
    written = {i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if i in special}
    return first[0], written


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn, and so every answer: the one the chat template writes right
    after an assistant message. Read from the template and the vocabulary, never from the tokenizer's
    eos, which a GGUF can get wrong (transformers 5.17 reads SmolLM2's as <|im_start|>)."""
    return _chat_tokens(tokenizer)[0]


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The end of text (when it is one) and the end of the assistant turn."""
    end, written = _chat_tokens(tokenizer)
    eos = tokenizer.eos_token_id
    # An eos the template writes inside a conversation frames turns (a misread <|im_start|>), it does not
    # end text: as a stop, a finished grammar could end on it and slot layouts could not hold it.
    if eos is None or eos == end or eos in written or eos not in tokenizer.added_tokens_decoder:
        return (end,)
    return (eos, end)


_DECODER = json.JSONDecoder()


def parse_json(text: str, opener: str | None = None) -> Any:
    """The JSON value starting at the first `opener` ("[" or "{") in `text`, or at its first non-blank
    character without one; None if there is none or it does not parse. Text after the value is ignored so
    an answer followed by chatter still scores."""
    start = text.find(opener) if opener else len(text) - len(text.lstrip())
    if start < 0:
        return None
    try:
        return _DECODER.raw_decode(text, start)[0]
    except (ValueError, RecursionError):
        return None


def parse_tool_call(text: str) -> dict | None:
    """The first JSON object in `text` (the body of `<tool_call>...</tool_call>`, or a whole answer);
    None if there is none or it does not parse. The server reads calls with this and the tool_call task
    scores with it, so both agree on what a call is."""
    return parse_json(text, "{")
