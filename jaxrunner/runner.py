"""The model runner: `state, out = runner.step(state, sched)`.

One step, top to bottom:
  1. check the SchedulerOutput and build the next host request table (a ValueError changes nothing);
  2. pad the batch to a token bucket and a request bucket and build the step's arrays;
  3. on the device (state donated): write changed block-table rows, run the backbone over the packed
     tokens with paged attention, then logits and sampling for the batch's rows;
  4. read the sampled tokens back and advance the table.
"""

from __future__ import annotations

import bisect
import os

import jax
import numpy as np

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.input_batch import RequestTable, batch_order, block_table_rows, build_inputs
from jaxrunner.loader import load_model
from jaxrunner.models.llama import Params
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.state import RunnerState, init_state
from jaxrunner.step import forward_step, sample_step, write_block_rows
from jaxrunner.step_io import RunnerOutput, SchedulerOutput


# Jitted once per process: runners with the same model config share compiled graphs.
_write_blocks = jax.jit(write_block_rows, donate_argnums=0)
_forward = jax.jit(forward_step, static_argnames=("model", "uniform_decode"), donate_argnums=1)
_sample = jax.jit(sample_step, static_argnames="model", donate_argnums=1)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


class Runner:
    def __init__(self, model_config: ModelConfig, params: Params, config: RunnerConfig = RunnerConfig()) -> None:
        self.model_config = model_config
        self.config = config
        self.params = params
        self._table = RequestTable.empty(config.max_num_seqs)
        self._rng = np.random.default_rng(config.seed)
        # Only GPUs have a decode-specialised attention kernel; elsewhere one graph per bucket does.
        self._decode_kernel = jax.default_backend() == "gpu"

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, config: RunnerConfig = RunnerConfig()) -> Runner:
        model_config, params = load_model(path, config.dtype)
        return cls(model_config, params, config)

    def init_state(self) -> RunnerState:
        return init_state(self.model_config, self.config)

    def check_sampling_params(self, params: SamplingParams, prompt_len: int = 0) -> None:
        """Raise a ValueError for sampling features this runner does not honour yet."""
        defaults = SamplingParams()
        unsupported = [
            name
            for name in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                         "logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "logprobs", "prompt_logprobs")
            if getattr(params, name) != getattr(defaults, name)
        ]
        if unsupported:
            raise ValueError(
                f"sampling parameters {', '.join(unsupported)} are not supported by this runner yet; "
                "use temperature and seed only"
            )

    def step(self, state: RunnerState, sched: SchedulerOutput) -> tuple[RunnerState, RunnerOutput]:
        cfg = self.config
        for new in sched.scheduled_new_reqs:
            self.check_sampling_params(new.sampling_params)
        table, dirty = self._table.apply(sched, cfg, self.model_config.vocab_size, self._rng)
        order = batch_order(table, sched)
        if not order:
            self._table = table
            return state, RunnerOutput([], {}, [])

        t_bucket = _bucket(sched.total_num_scheduled_tokens, cfg.token_buckets)
        b_bucket = _bucket(len(order), cfg.request_buckets)
        token_inputs, sample_inputs, sampled = build_inputs(table, order, sched.num_scheduled_tokens, cfg, t_bucket, b_bucket)
        if dirty:
            slots, rows = block_table_rows(table, dirty, cfg, _bucket(len(dirty), cfg.request_buckets))
            state = _write_blocks(state, slots, rows)
        decode = self._decode_kernel and all(n == 1 for n in sched.num_scheduled_tokens.values())
        last_hidden, state = _forward(self.params, state, token_inputs, model=self.model_config, uniform_decode=decode)
        tokens, state = _sample(self.params, state, last_hidden, sample_inputs, model=self.model_config)

        tokens = np.asarray(tokens)
        self._table = table.after_sampling(sched.num_scheduled_tokens, sampled)
        return state, RunnerOutput(
            req_ids=order,
            req_id_to_index={rid: i for i, rid in enumerate(order)},
            sampled_token_ids=[[int(tokens[i])] if rid in sampled else [] for i, rid in enumerate(order)],
        )

    def compile_forward(self, state: RunnerState, num_tokens: int, uniform_decode: bool = False) -> jax.stages.Compiled:
        """The compiled backbone for the bucket holding `num_tokens` (its memory_analysis() proves no KV copy)."""
        t_bucket = _bucket(num_tokens, self.config.token_buckets)
        token_inputs, _, _ = build_inputs(self._table, [], {}, self.config, t_bucket, 1)
        return _forward.lower(self.params, state, token_inputs, model=self.model_config, uniform_decode=uniform_decode).compile()
