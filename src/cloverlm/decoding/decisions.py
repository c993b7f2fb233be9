"""Joint decisions: up to 8 related questions answered in one generation.

The answer is a fixed layout, {"1":"<answer 1>","2":"<answer 2>",...}, decoded as one block: the layout's
tokens are given and every answer slot starts as [MASK], restricted to its options (each option one
token). All slots are denoised together, so each answer is chosen seeing the others, committed or still
open; the most confident goes first. One-at-a-time answering (joint=False) asks each question alone
with the same prompt, a layout holding only its own slot.

`decide` runs on an engine; the server's `/v1/decisions` builds the same requests; cloverlm.bench.decisions
compares both ways on the drone_slots task.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import Completion, DecodeParams, Request, Slots, distinct_choices
from cloverlm.errors import CloverError
from cloverlm.tokenizer import format_chat, stop_token_ids

MAX_QUESTIONS = 8
Question = tuple[str, Sequence[str]]  # (question, options)


@dataclass
class Decision:
    answers: list[str]
    forwards: int  # summed over the requests (one when joint)
    seconds: float


def _token(tokenizer, text: str) -> int:
    ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) != 1:
        raise CloverError(f"option {text!r} is {len(ids)} tokens; every option must be exactly one token")
    return ids[0]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def decision_prompt(tokenizer, questions: Sequence[Question], context: str = "") -> list[int]:
    """The chat prompt listing every question with its options (the same for joint and one at a time)."""
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise CloverError(f"give 1..{MAX_QUESTIONS} questions, got {len(questions)}")
    listed = "\n".join(f"{i + 1}. {text} ({' / '.join(options)})" for i, (text, options) in enumerate(questions))
    user = (context.strip() + "\n\n" if context.strip() else "") + "Answer every question with one of its options, as JSON:\n" + listed
    return _encode(tokenizer, format_chat(tokenizer, user)[0])


def decision_layout(tokenizer, questions: Sequence[Question], indices: Sequence[int], distinct: bool = False) -> Slots:
    """{"i":"<slot>",...} over the questions at `indices`, each slot restricted to its options; with
    `distinct` no two answers may be the same."""
    layout: list[int | None] = []
    options = []
    for k, index in enumerate(indices):
        layout += _encode(tokenizer, ("{" if k == 0 else ",") + f'"{index + 1}":"') + [None]
        layout += _encode(tokenizer, '"')
        options.append(sorted({_token(tokenizer, option) for option in questions[index][1]}))
    return Slots(layout + _encode(tokenizer, "}"), options, distinct)


def decision_requests(
    tokenizer, questions: Sequence[Question], context: str, joint: bool, params: DecodeParams, distinct: bool = False
) -> list[Request]:
    """One request holding every slot (joint), or one per question (then `distinct` cannot apply).
    Distinct answers that cannot all be given (three yes/no questions) are refused here, before decoding."""
    for text, options in questions:
        if not options:
            raise CloverError(f"the question {text!r} has no options")
    if distinct and joint:
        crowded = distinct_choices([{_token(tokenizer, o) for o in options} for _, options in questions])[1]
        if crowded:
            shared = sorted({o for i in crowded for o in questions[i][1]})
            raise CloverError(f"distinct answers are impossible: questions {', '.join(str(i + 1) for i in crowded)} "
                              f"have only {len(shared)} different option{'s' if len(shared) != 1 else ''} between them ({', '.join(shared)})")
    prompt = decision_prompt(tokenizer, questions, context)
    groups = [list(range(len(questions)))] if joint else [[i] for i in range(len(questions))]
    return [Request(prompt, params, request_id=group, slots=decision_layout(tokenizer, questions, group, distinct))
            for group in groups]


def slot_answers(tokenizer, request: Request, completion: Completion) -> list[str]:
    """The chosen option at each slot of a finished decision request."""
    positions = [i for i, token in enumerate(request.slots.layout) if token is None]
    return [tokenizer.decode([completion.tokens[i]]) for i in positions]


def decide(
    model, tokenizer, questions: Sequence[Question], context: str = "", joint: bool = True,
    params: DecodeParams | None = None, engine: Engine | None = None, distinct: bool = False,
) -> Decision:
    """Answer `questions` (each (text, options), options one token each): jointly in one generation, or
    one at a time (each its own generation, run one after another). `distinct` (joint only): no two
    answers alike, enforced while the slots are unmasked."""
    params = params or DecodeParams()
    params = replace(params, stop_token_ids=tuple(params.stop_token_ids) or stop_token_ids(tokenizer))
    engine = engine or Engine(model)
    answers, forwards, started = [], 0, time.perf_counter()
    for request in decision_requests(tokenizer, questions, context, joint, params, distinct):
        [completion] = engine.generate([request])
        answers += slot_answers(tokenizer, request, completion)
        forwards += completion.forwards
    return Decision(answers, forwards, time.perf_counter() - started)
