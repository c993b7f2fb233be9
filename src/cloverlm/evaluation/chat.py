"""How close a converted model stays to its base on held-out chat prompts (data/chat_distill/heldout.jsonl:
the base's own greedy answers)."""

from __future__ import annotations

import json

import torch

from cloverlm.errors import CloverError
from cloverlm.paths import DATA
from cloverlm.tokenizer import format_chat, stop_token_ids

CHAT_DATA = DATA / "chat_distill"


def read_chat(split: str) -> list[dict]:
    path = CHAT_DATA / f"{split}.jsonl"
    if not path.is_file():
        raise CloverError(f"self-distilled chat data missing: {path} (make it with scripts/distill_chat.py)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _prompt_ids(tokenizer, record: dict) -> list[int]:
    return tokenizer(format_chat(tokenizer, record["prompt"])[0], add_special_tokens=False)["input_ids"]


@torch.no_grad()
def teacher_forced_agreement(model, tokenizer, records: list[dict]) -> list[float]:
    """Per prompt, the share of the base's answer tokens that are the model's argmax given the base's own
    prefix: the per-token agreement, free of the compounding of a free-running comparison. Clover's
    forward of one sequence is its B = 1 prediction; the peer is a causal LM: both give .logits."""
    shares = []
    for record in records:
        prompt = _prompt_ids(tokenizer, record)
        ids = torch.tensor([prompt + record["answer_ids"]])
        predicted = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
        shares.append(float((predicted == ids[0, len(prompt) :]).float().mean()))
    return shares


def chat_agreement(model, tokenizer, records: list[dict]) -> dict:
    """Clover's agreement with the base, three ways: free-running (the share of the base's answer tokens
    that the B = 1 greedy answer matches position by position: one early divergence shifts everything
    after it, so this is strict), the share of answers reproduced whole and the median first divergence;
    and teacher-forced (teacher_forced_agreement, over all answer tokens)."""
    from cloverlm.decoding.engine import Engine
    from cloverlm.decoding.params import DecodeParams, Request

    engine = Engine(model, max_batch_size=8)
    for index, record in enumerate(records):
        params = DecodeParams(max_new_tokens=len(record["answer_ids"]), block_size=1, stop_token_ids=stop_token_ids(tokenizer))
        engine.submit(Request(_prompt_ids(tokenizer, record), params, request_id=index))
    same = total = whole = 0
    divergences = []
    for completion in engine.run():
        reference = records[completion.request_id]["answer_ids"]
        same += sum(a == b for a, b in zip(completion.tokens, reference))
        total += len(reference)
        whole += completion.tokens == reference
        divergences.append(next((i for i, (a, b) in enumerate(zip(completion.tokens, reference)) if a != b), len(reference)))
    shares = teacher_forced_agreement(model, tokenizer, records)
    lengths = [len(r["answer_ids"]) for r in records]
    return {
        "prompts": len(records), "token_agreement": round(same / max(total, 1), 4),
        "answers_equal": round(whole / len(records), 4), "median_first_divergence": sorted(divergences)[len(divergences) // 2],
        "teacher_forced_agreement": round(sum(s * n for s, n in zip(shares, lengths)) / max(sum(lengths), 1), 4),
    }  # fmt: skip
