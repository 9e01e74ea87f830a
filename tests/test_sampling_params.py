"""SamplingParams: clear ValueErrors for invalid parameters, on construction and in verify()."""

from __future__ import annotations

import math

import pytest

from jaxrunner.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -3}, "prompt_logprobs"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -4]}, "allowed_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[1, -2]]}, "bad_words_token_ids"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"n": 0}, "n must"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_invalid_parameters_raise_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_edge_values_construct():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, seed=2**64 - 1, logprobs=-1, prompt_logprobs=0)
    SamplingParams(logit_bias={0: -100, 5: 100.0}, allowed_token_ids=[0], bad_words_token_ids=[[3]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logprobs": 21}, "maximum of 20"),
        ({"prompt_logprobs": 25}, "maximum of 20"),
        ({"logprobs": -1}, "asks for 100"),
        ({"logit_bias": {100: 1.0}}, "logit_bias holds token ids \\[100\\] outside the vocabulary"),
        ({"allowed_token_ids": [5, 120]}, "allowed_token_ids"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"bad_words_token_ids": [[1, 100]]}, "bad_words_token_ids"),
        ({"bad_words": ["hello"]}, "tokenized first"),
    ],
)
def test_verify_rejects_what_the_model_rules_out(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).verify(vocab_size=100, max_logprobs=20)


def test_verify_accepts_what_fits():
    SamplingParams(logprobs=20, prompt_logprobs=0, logit_bias={99: 1.0}, allowed_token_ids=[0, 99]).verify(100, 20)
    SamplingParams(logprobs=-1).verify(100, max_logprobs=-1)
    SamplingParams(logprobs=50).verify(100, max_logprobs=64)


class FakeTokenizer:
    ids = {"bad": [1], " bad": [2], "two words": [3, 4], " two words": [5, 4], "same": [6, 7], " same": [6, 8]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.ids[text]


def test_bad_words_are_tokenized_with_and_without_a_leading_space():
    params = SamplingParams(bad_words=["bad", "  two words", "same"]).with_bad_words_tokenized(FakeTokenizer())
    assert params.bad_words_token_ids == [[1], [2], [3, 4], [5, 4], [6, 7]]
    params.verify(vocab_size=10, max_logprobs=20)


def test_greedy_below_the_threshold():
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
