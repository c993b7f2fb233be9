"""The end of turn comes from the chat template and the vocabulary, not from the tokenizer's eos: a GGUF's
eos metadata reads differently across transformers 5.x (5.17 reads SmolLM2's as <|im_start|>)."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from cloverlm.convert.base import check_tokenizer, clover_config, repair_eos
from cloverlm.convert.load import load_folder_tokenizer
from cloverlm.errors import CloverError
from cloverlm.tokenizer import end_of_turn_id, load_tokenizer, stop_token_ids

BASE_TOKENIZER = "models/smollm2-clover"  # the base's tokenizer, as the shipped adapter loads it
END, START, TEXT_END, MASK = 2, 1, 0, 4  # SmolLM2: <|im_end|>, <|im_start|>, <|endoftext|>, <reponame>


@pytest.fixture
def base_tokenizer():
    """A fresh copy each test: the tests change its eos."""
    tokenizer = load_folder_tokenizer(BASE_TOKENIZER)
    assert tokenizer.convert_ids_to_tokens([END, START, TEXT_END]) == ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]
    return tokenizer


@pytest.fixture
def misread(base_tokenizer):
    """The base tokenizer as transformers 5.17 reads it from the GGUF."""
    base_tokenizer.eos_token = "<|im_start|>"
    return base_tokenizer


def test_the_base_stops_at_the_end_of_turn(base_tokenizer):
    assert end_of_turn_id(base_tokenizer) == END
    assert stop_token_ids(base_tokenizer) == (END,)
    assert check_tokenizer(base_tokenizer) == MASK


def test_clovers_own_tokenizer_stops_at_end_of_text_and_end_of_turn(tokenizer):
    assert stop_token_ids(tokenizer) == (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) == (0, 4)


def test_a_misread_eos_never_stops_on_a_turn_opener(misread):
    assert end_of_turn_id(misread) == END
    assert stop_token_ids(misread) == (END,)
    with pytest.raises(CloverError, match=r"^the base's end of text is '<\|im_start\|>', expected <\|im_end\|>"):
        check_tokenizer(misread)


def test_an_end_of_text_eos_still_stops(base_tokenizer):
    base_tokenizer.eos_token = "<|endoftext|>"
    assert stop_token_ids(base_tokenizer) == (TEXT_END, END)


def test_the_repair_reaches_the_saved_tokenizer_and_the_configs(misread, tmp_path):
    config = LlamaConfig(vocab_size=len(misread), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=START, bos_token_id=START)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = START
    repair_eos(misread, model)
    assert (misread.eos_token, misread.eos_token_id) == ("<|im_end|>", END)
    assert (model.config.eos_token_id, model.generation_config.eos_token_id) == (END, END)
    assert check_tokenizer(misread) == MASK
    assert clover_config(model.config, MASK).eos_token_id == END
    misread.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).eos_token == "<|im_end|>"


def test_the_repair_keeps_a_right_eos(base_tokenizer):
    repair_eos(base_tokenizer)
    assert (base_tokenizer.eos_token_id, check_tokenizer(base_tokenizer)) == (END, MASK)


def test_a_template_ending_turns_otherwise_is_not_a_chatml_base(base_tokenizer):
    base_tokenizer.chat_template = (
        "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{%- endfor -%}"
    )
    assert end_of_turn_id(base_tokenizer) == TEXT_END
    with pytest.raises(CloverError, match=r"^the chat template ends a turn with '<\|endoftext\|>', expected <\|im_end\|>"):
        check_tokenizer(base_tokenizer)


def test_no_chatml_tokens_is_one_line():
    """Byte-level BPE without the ChatML tokens: the template's <|im_end|> is ordinary text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(["hello world, hi there"], trainer=trainer)
    plain = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    expected = (
        "no end-of-turn token: the chat template does not close an assistant turn with a single special token "
        "(a ChatML vocabulary has <|im_start|> and <|im_end|>)"
    )
    for read in (end_of_turn_id, stop_token_ids, repair_eos):
        with pytest.raises(CloverError) as caught:
            read(plain)
        assert str(caught.value) == expected
