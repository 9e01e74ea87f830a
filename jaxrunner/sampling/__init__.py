"""The sampler: vLLM model runner v2's sampling, as pure JAX functions plus host-side packing.

Host side (numpy, `metadata.py`), for a model of `vocab_size` tokens and the engine-wide
`config.SamplerConfig`:
- `prepare_request(params, seed, prompt_len, config, vocab_size, eos_token_ids) -> RequestSampling`,
  once per request when it arrives (also after preemption); raises ValueError for what the model or
  limits rule out. `seed` is params.seed or a 64-bit seed the runner drew.
- `build_sampling_metadata(requests, positions, num_rows, config, vocab_size, variants=(), grammar_bitmask=None,
  masks_per_row=1) ->
  (SamplingMetadata, SamplerFlags)` every step, for the B = num_rows rows of a request bucket;
  positions[i] is the position of the token row i samples (= the tokens before it);
  `grammar_bitmask` (i32 [len(requests), masks_per_row * ceil(V / 32)]) turns on grammar masks.
- `SamplerFlags` (hashable, a static jit argument): penalties, top_k_top_p, min_p, logit_bias,
  allowed_token_ids, bad_words, min_tokens, grammar, num_logprobs (-1: none, else the logprobs
  width), logprobs_mode, count_nans. The flags fix every shape, so graphs = distinct flags x request
  buckets. With `variants=flag_variants(config, vocab_size)` each batch is promoted to the first
  of 12 covering variants (plain, top-k/top-p/min-p, everything; each without and with logprobs;
  those six without and with grammar masks): 12 x R graphs, all known in advance (`neutral_metadata(B, config, vocab_size, flags)` is the
  example input for AOT compiles). Without `variants`, each combination met compiles.

Device side (pure, jittable; `sampler.py`):
- `sample(logits f32[B, V], md, flags, history i32[B, L], kernels) -> SamplerOutput(tokens i32[B],
  logprobs f32[B, K], logprob_token_ids i32[B, K], ranks i32[B], num_nans i32[B])`, K = 1 +
  flags.num_logprobs or 0. history holds each row's tokens (prompt, then generated); the first
  md.positions[b] are read, by penalties and bad words only (pass [B, 0] without them).
- `process_logits(...)`: the logits the sample is drawn from (vLLM's "processed").
- `compute_logprobs(logits [N, V], target_ids [N], num_top, as_logits) -> (values [N, 1+n],
  ids [N, 1+n], ranks [N])`: for sampled tokens and for prompt logprobs.

Prompt logprobs (`prompt_logprobs.py`): `prompt_logprob_positions(prompt_len, prefill_len, num_computed,
num_scheduled)` gives the chunk's positions to score (position p scores prompt token p + 1; none
after preemption); `PromptLogprobsBuffer.add(req_id, part, prompt_done)` returns the whole
prompt's `LogprobsArrays` once, in the step that completes the prompt; `discard(req_id)` on
finish or preemption.
"""

from jaxrunner.sampling.logprobs import compute_logprobs
from jaxrunner.sampling.metadata import (
    NO_LOGPROBS,
    RequestSampling,
    SamplerFlags,
    SamplingMetadata,
    build_sampling_metadata,
    flag_variants,
    mask_words,
    neutral_metadata,
    prepare_request,
)
from jaxrunner.sampling.prompt_logprobs import (
    PROMPT_LOGPROBS_CHUNK,
    PromptLogprobsBuffer,
    PromptScoring,
    prompt_logprob_positions,
    prompt_scoring,
)
from jaxrunner.sampling.sampler import SamplerOutput, process_logits, sample

__all__ = [
    "NO_LOGPROBS",
    "PROMPT_LOGPROBS_CHUNK",
    "PromptLogprobsBuffer",
    "PromptScoring",
    "RequestSampling",
    "SamplerFlags",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_logprobs",
    "flag_variants",
    "mask_words",
    "neutral_metadata",
    "prepare_request",
    "process_logits",
    "prompt_logprob_positions",
    "prompt_scoring",
    "sample",
]
