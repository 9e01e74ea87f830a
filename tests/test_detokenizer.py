"""Incremental detokenization and stop strings, checked against vLLM's documented behaviour."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxrunner.engine.default_model import default_tokenizer
from jaxrunner.engine.detokenizer import IncrementalDetokenizer
from jaxrunner.sampling_params import SamplingParams

TEXT = "Hello wörld, ça va? 你好 🎉 naïve café, hello again"


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE trained on TEXT: merges, leading-space tokens and multi-byte characters
    split across tokens, like GPT-2 / Llama 3 tokenizers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator([TEXT[:20]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def chars():
    return default_tokenizer()


def stream(tokenizer, text: str, params: SamplingParams, prompt: str = "Q: ", step: int = 1):
    """Feed `text`'s tokens `step` at a time; (detokenizer, stop string, tokens fed)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    for i in range(0, len(ids), step):
        stop = detok.update(ids[i : i + step], stop_terminated=False)
        if stop is not None:
            return detok, stop, i + step
    return detok, None, len(ids)


@pytest.mark.parametrize("step", [1, 3])
def test_incremental_text_equals_full_decode(byte_bpe, step):
    detok, _, _ = stream(byte_bpe, TEXT, SamplingParams(), step=step)
    assert detok.output_text == TEXT
    assert any(len(byte_bpe.decode([t]).encode()) != len(byte_bpe.decode([t])) for t in byte_bpe.encode(TEXT))


def test_incomplete_characters_are_held_back(byte_bpe):
    ids = byte_bpe.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(byte_bpe, byte_bpe.encode("x"), SamplingParams())
    for t in ids[:-1]:
        detok.update([t], stop_terminated=False)
        assert detok.output_text == ""
    detok.update(ids[-1:], stop_terminated=False)
    assert detok.output_text == "🎉"


def test_leading_space_comes_from_context(byte_bpe):
    detok, _, _ = stream(byte_bpe, " again", SamplingParams(), prompt="hello")
    assert detok.output_text == " again"


def test_stop_string_cut_before_it(chars):
    detok, stop, fed = stream(chars, "abcXYZdef", SamplingParams(stop=["XYZ"]))
    assert (stop, detok.output_text, fed) == ("XYZ", "abc", 6)  # matched on the token that completes it


def test_stop_string_included_on_request(chars):
    detok, stop, _ = stream(chars, "abcXYZdef", SamplingParams(stop="XYZ", include_stop_str_in_output=True))
    assert (stop, detok.output_text) == ("XYZ", "abcXYZ")


def test_text_after_the_stop_string_in_the_same_step_is_dropped(chars):
    detok, stop, _ = stream(chars, "abcXYZdef", SamplingParams(stop="XYZ", include_stop_str_in_output=True), step=9)
    assert (stop, detok.output_text) == ("XYZ", "abcXYZ")


def test_first_stop_string_in_list_order_wins(chars):
    # Both match in the same step: vLLM takes the first of the list, not the earliest in the text.
    detok, stop, _ = stream(chars, "xxabcyy", SamplingParams(stop=["y", "abc"]), step=7)
    assert (stop, detok.output_text) == ("y", "xxabc")


def test_stop_string_spanning_steps(chars):
    detok, stop, fed = stream(chars, "12345678", SamplingParams(stop=["3456"]), step=3)
    assert (stop, detok.output_text, fed) == ("3456", "12", 6)


def test_stop_token_text_is_excluded_unless_asked(chars):
    ids = chars.encode("ab!", add_special_tokens=False)
    for include, text in ((False, "ab"), (True, "ab!")):
        detok = IncrementalDetokenizer(
            chars, [1], SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
        )
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.output_text == text


def test_min_tokens_protects_early_text(chars):
    detok, stop, fed = stream(chars, "ab-cd-ef", SamplingParams(stop="-", min_tokens=3))
    assert (stop, detok.output_text, fed) == ("-", "ab-cd", 6)


def test_streaming_holds_back_a_possible_stop_prefix(chars):
    ids = chars.encode("hello STOP world", add_special_tokens=False)
    detok = IncrementalDetokenizer(chars, [1], SamplingParams(stop="STOP"))
    pieces = []
    for t in ids:
        stop = detok.update([t], stop_terminated=False)
        pieces.append(detok.text(finished=stop is not None, delta=True))
        assert "S" not in "".join(pieces)  # never shows a prefix of the stop string
        if stop:
            break
    assert "".join(pieces) == detok.text(finished=True) == "hello "
