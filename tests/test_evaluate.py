"""The evaluation decodes answers under their schemas by default (Clover and the peer alike), and free on
request; it reports which, and the share of answer tokens the grammar forced."""

import json

from cloverlm import tasks
from cloverlm.decoding.grammar import Grammars
from cloverlm.evaluation.evaluate import answer_grammar, evaluate_tasks, forced_count
from cloverlm.tokenizer import stop_token_ids


def test_answers_are_decoded_under_the_schema_unless_free(tokenizer, random_model):
    constrained = evaluate_tasks(random_model, tokenizer, ["kv_retrieval"], 2, block_size=4, threshold=0.9, sizes={"kv_retrieval": {"n_pairs": 4}})
    free = evaluate_tasks(random_model, tokenizer, ["kv_retrieval"], 2, block_size=4, threshold=0.9, sizes={"kv_retrieval": {"n_pairs": 4}}, answers="free")
    assert constrained["kv_retrieval"]["constrained"] and not free["kv_retrieval"]["constrained"]
    assert (constrained["kv_retrieval"]["answers"], free["kv_retrieval"]["answers"]) == ("grounded", "free")
    assert 0 < constrained["kv_retrieval"]["forced_share"] < 1 and "forced_share" not in free["kv_retrieval"]


def test_forced_tokens_of_a_reference_answer(tokenizer):
    """The grammar of a kv_retrieval answer forces its keys and punctuation, never its values."""
    example = tasks.generate("kv_retrieval", 1_000_000_000, n_pairs=6)
    grammars = Grammars(tokenizer, len(tokenizer), stop_token_ids(tokenizer))
    grammar = answer_grammar(grammars, tasks.get_task("kv_retrieval"), example)
    answer = tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    forced = forced_count(grammars.constraint(grammar), answer)
    values = "".join(json.loads(example.answer).values())
    assert 0 < forced < len(answer) and len(tokenizer(values, add_special_tokens=False)["input_ids"]) <= len(answer) - forced
