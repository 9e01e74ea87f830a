"""Property test: random sampling parameters, valid and invalid, and random aborts, through LLMEngine.

Each field's value is drawn from a strategy of valid values or one of invalid values, so the test
knows which fields are wrong without re-deriving the rules: a request with a wrong field must raise a
ValueError that names one of them and queue nothing; every other request must complete (or end by
its abort) within its limits; afterwards no KV block is held, and a canary gives the same tokens.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrunner import LLM, SamplingParams
from jaxrunner.engine.default_model import TINY_MODEL

VOCAB = 99  # the built-in model's
ENGINE = {"model": TINY_MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, "num_gpu_blocks_override": 12,
          "block_size": 8}
CANARY = ("Canary", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
floats = st.floats(allow_nan=False, allow_infinity=False)
token = st.integers(0, VOCAB - 1)
word = st.text("abcdefgh", min_size=1, max_size=4)

# field: (valid values, invalid values). Invalid values of logprobs, stop_token_ids and logit_bias
# include ones only the engine can rule out (over its logprobs limit, outside the vocabulary).
FIELDS = {
    "n": (st.integers(1, 2), st.one_of(st.integers(max_value=0), st.just(1.5), st.just(True))),
    "max_tokens": (st.integers(5, 14), st.one_of(st.integers(max_value=0), st.just(2.5))),
    "min_tokens": (st.integers(0, 4), st.one_of(st.integers(max_value=-1), st.just(1.5))),
    # (not `floats.filter(lambda t: t < 0)`: Hypothesis reads it as floats below 0.0, which lets -0.0 in)
    "temperature": (floats.filter(lambda t: 0 <= t <= 2),
                    st.one_of(st.floats(max_value=-1e-6, allow_infinity=False), st.sampled_from([math.inf, math.nan, "1"]))),
    "top_p": (floats.filter(lambda p: 0.05 <= p <= 1), st.one_of(st.just(0.0), floats.filter(lambda p: p > 1))),
    "top_k": (st.one_of(st.just(-1), st.integers(1, 200)), st.one_of(st.just(0), st.integers(max_value=-2), st.just(2.5))),
    "min_p": (floats.filter(lambda p: 0 <= p <= 1), st.one_of(floats.filter(lambda p: p > 1), st.just(math.nan))),
    "presence_penalty": (floats.filter(lambda p: -2 <= p <= 2), floats.filter(lambda p: abs(p) > 2)),
    "repetition_penalty": (floats.filter(lambda p: 0.5 <= p <= 2), st.sampled_from([0.0, -1.0, math.inf])),
    "seed": (st.one_of(st.none(), st.integers(0, 2**32)),
             st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), st.just(1.5))),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.integers(max_value=-2), st.integers(21, 60))),
    "stop_token_ids": (st.lists(token, max_size=3),
                       st.sampled_from([[-1], [VOCAB + 5], [True], [1.5], "3"])),
    "logit_bias": (st.dictionaries(token, floats.filter(lambda b: abs(b) < 5), max_size=3),
                   st.sampled_from([{VOCAB: 1.0}, {1: math.nan}, {-3: 1.0}, [1, 2]])),
    "stop": (st.one_of(st.none(), st.lists(word, min_size=1, max_size=2)), st.sampled_from([5, [None], [""], [1]])),
    "bad_words": (st.lists(word, max_size=2), st.sampled_from([[""], "word", [3]])),
}


@st.composite
def request(draw) -> tuple[dict, set[str]]:
    """Sampling kwargs and the names of the fields given invalid values."""
    kwargs, invalid = {}, set()
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        valid_values, invalid_values = FIELDS[name]
        if draw(st.booleans()) and draw(st.booleans()):  # a quarter of the fields set are wrong
            kwargs[name] = draw(invalid_values)
            invalid.add(name)
        else:
            kwargs[name] = draw(valid_values)
    return kwargs, invalid


@pytest.fixture(scope="module")
def llm():
    with LLM(**ENGINE) as llm:
        yield llm


def test_random_parameters_and_aborts(llm):
    engine = llm.llm_engine
    canary = llm.generate(*CANARY, use_tqdm=False)[0].outputs[0].token_ids
    ids = iter(range(10**6))

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(request(), st.text("abcdef ", min_size=1, max_size=20), st.none() | st.integers(0, 8)),
                    min_size=1, max_size=4))
    def check(batch):
        added = {}
        for (kwargs, invalid), prompt, abort_at in batch:
            request_id = f"r{next(ids)}"
            try:
                engine.add_request(request_id, prompt, SamplingParams(**kwargs))
            except ValueError as e:
                assert invalid, f"valid parameters {kwargs} raised: {e}"
                assert any(name in str(e) for name in invalid), f"{e} names none of {sorted(invalid)}"
                continue
            assert not invalid, f"invalid {sorted(invalid)} accepted: {kwargs}"
            added[request_id] = (SamplingParams(**kwargs), abort_at)
        finals, step = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in finals
                    finals[out.request_id] = out
            engine.abort_request([rid for rid, (_, at) in added.items() if at == step and rid not in finals])
            step += 1
        assert finals.keys() == added.keys()
        for request_id, (params, abort_at) in added.items():
            out = finals[request_id]
            reasons = {c.finish_reason for c in out.outputs}
            assert reasons <= ({"stop", "length", "abort"} if abort_at is not None else {"stop", "length"}), reasons
            for c in out.outputs:
                assert len(c.token_ids) <= params.max_tokens
                if c.finish_reason in ("stop", "length"):
                    assert len(c.token_ids) >= min(params.min_tokens, params.max_tokens)
        engine.drain()  # the step dispatched after the last finish: its tokens are dropped
        manager = engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks and not engine.has_unfinished_requests()

    check()
    assert llm.generate(*CANARY, use_tqdm=False)[0].outputs[0].token_ids == canary
