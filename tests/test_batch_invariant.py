"""`batch_invariant=True`: a request's tokens and logprobs are the same bits alone and in any batch.

Random weights in a shape whose matmuls XLA:CPU sums differently by the number of rows (hidden 576,
as SmolLM2's; the tiny shapes are too small to show it). Hypothesis draws the batch around a target
request (how many others, their lengths, the target's place, greedy or seeded sampling); the engine
chunks long prefills and the prefix cache serves the target's prompt once it ran alone.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrunner import LLM, SamplingParams
from jaxrunner.runner.programs import SAMPLE

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 576,
          "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
          "head_dim": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
TARGET = [int(t) for t in np.random.default_rng(7).integers(3, 1024, 41)]
ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=160, max_num_seqs=8,
              max_num_batched_tokens=64, num_gpu_blocks_override=96)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("invariant")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, batch_invariant=True, **ENGINE) as llm:
        yield llm


def params(seeded: bool) -> SamplingParams:
    return SamplingParams(temperature=1.0 if seeded else 0.0, seed=11 if seeded else None, max_tokens=10,
                          ignore_eos=True, logprobs=4)


def run(llm: LLM, prompts: list[list[int]], sampling: SamplingParams, at: int) -> tuple[list[int], list]:
    """Prompt `at`'s tokens, and per token its (token id, logprob as the float's bytes) pairs."""
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)[at].outputs[0]
    return out.token_ids, [sorted((t, np.float32(lp.logprob).tobytes()) for t, lp in step.items()) for step in out.logprobs]


@pytest.fixture(scope="module")
def alone(model_dir):
    """The target alone on an engine without a prefix cache: greedy, and seeded."""
    with LLM(model_dir, batch_invariant=True, enable_prefix_caching=False, **ENGINE) as llm:
        yield {seeded: run(llm, [TARGET], params(seeded), 0) for seeded in (False, True)}, llm.llm_engine.runner


@pytest.mark.parametrize("seeded", [False, True])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(others=st.lists(st.integers(1, 90), max_size=5), place=st.integers(0, 5))
def test_a_request_gives_the_same_bits_in_any_batch(llm, alone, seeded, others, place):
    """In batches drawn by hypothesis, its prompt chunked with the others' (64 tokens a step) or
    served from the prefix cache after the first batch."""
    rng = np.random.default_rng(len(others) * 100 + place)
    batch = [[int(t) for t in rng.integers(3, 1024, n)] for n in others]
    place = min(place, len(batch))
    batch.insert(place, TARGET)
    tokens, logprobs = run(llm, batch, params(seeded), place)
    want_tokens, want_logprobs = alone[0][seeded]
    assert tokens == want_tokens and logprobs == want_logprobs  # bitwise, not within a tolerance


def test_the_mode_tiles_the_rows_and_refuses_what_it_does_not_cover(alone, model_dir):
    """Its programs run their row-sized products one tile at a time (a loop in the compiled
    forward pass and sampler), and what it does not cover is named at start."""
    runner = alone[1]
    ctx, flags = runner.ctx, runner.ctx.sampler_variants[0]
    sampler = runner.programs.program(SAMPLE, params=ctx.params, state=ctx.state, last_hidden=ctx.last_hidden(),
                                      samples=ctx.samples(4, flags), flags=flags)
    for text in (runner.compile_forward(16).as_text(), runner.programs.executable(sampler).as_text()):
        assert re.search(r"\bwhile\(", text)
    with pytest.raises(ValueError, match="batch_invariant does not combine with speculative decoding"):
        LLM(model_dir, batch_invariant=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            **ENGINE)
