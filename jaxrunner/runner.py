"""The model runner: `state, out = runner.step(state, sched)`.

One step, top to bottom:
  1. check the SchedulerOutput and build the next host request table (a ValueError changes nothing);
  2. pad the batch to a token bucket and a request bucket and build the step's arrays;
  3. on the device (state donated): write changed block-table rows, run the backbone over the packed
     tokens with paged attention, then logits and sampling for the batch's rows (and prompt
     logprobs for requests that ask for them);
  4. read the sampled tokens back and advance the table.
"""

from __future__ import annotations

import bisect
import os
import time

import jax
import numpy as np

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.input_batch import RequestTable, SampleInputs, batch_order, block_table_rows, build_inputs
from jaxrunner.loader import load_model
from jaxrunner.models.llama import Params
from jaxrunner.sampling import (
    LogprobsArrays,
    PromptLogprobsBuffer,
    SamplerConfig,
    flag_variants,
    neutral_metadata,
    prepare_request,
    prompt_logprob_positions,
)
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.state import RunnerState, init_state, kv_cache_bytes
from jaxrunner.step import forward_step, prompt_logprobs_step, sample_step, write_block_rows
from jaxrunner.step_io import RunnerOutput, SchedulerOutput


# Jitted once per process: runners with the same model config share compiled graphs.
_write_blocks = jax.jit(write_block_rows, donate_argnums=0)
_forward = jax.jit(forward_step, static_argnames=("model", "uniform_decode"), donate_argnums=1)
_sample = jax.jit(sample_step, static_argnames=("model", "flags"), donate_argnums=1)
_prompt_logprobs = jax.jit(prompt_logprobs_step, static_argnames=("model", "num_top", "as_logits"))

# Prompt positions scored per device call: bounds the [rows, vocab] logits of long prompts.
PROMPT_LOGPROBS_CHUNK = 256


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


class Runner:
    def __init__(self, model_config: ModelConfig, params: Params, config: RunnerConfig = RunnerConfig()) -> None:
        self.model_config = model_config
        self.config = config
        self.params = params
        self.sampler_config = SamplerConfig(
            vocab_size=model_config.vocab_size,
            max_logprobs=config.max_logprobs,
            logprobs_mode=config.logprobs_mode,
            eos_token_ids=model_config.eos_token_ids,
        )
        self._table = RequestTable.empty(config.max_num_seqs)
        self._prompt_logprobs = PromptLogprobsBuffer()
        self._rng = np.random.default_rng(config.seed)
        # Only GPUs have a decode-specialised attention kernel; elsewhere one graph per bucket does.
        self._decode_kernel = jax.default_backend() == "gpu"
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(config.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, config: RunnerConfig = RunnerConfig()) -> Runner:
        model_config, params = load_model(path, config.dtype)
        return cls(model_config, params, config)

    def init_state(self) -> RunnerState:
        return init_state(self.model_config, self.config)

    def check_sampling_params(self, params: SamplingParams, prompt_len: int = 0) -> None:
        """Raise a ValueError for parameters this model or runner rules out (token ids, logprob counts)."""
        prepare_request(params, 0, prompt_len, self.sampler_config)

    def step(self, state: RunnerState, sched: SchedulerOutput) -> tuple[RunnerState, RunnerOutput]:
        cfg = self.config
        table, dirty = self._table.apply(sched, cfg, self.sampler_config, self._rng)
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self._prompt_logprobs.discard(rid)
        order = batch_order(table, sched)
        if not order:
            self._table = table
            return state, RunnerOutput([], {}, [])

        scheduled = sched.num_scheduled_tokens
        t_bucket = _bucket(sched.total_num_scheduled_tokens, cfg.token_buckets)
        b_bucket = _bucket(len(order), cfg.request_buckets)
        token_inputs, sample_inputs, flags, sampled = build_inputs(
            table, order, scheduled, cfg, self.sampler_config, t_bucket, b_bucket
        )
        if dirty:
            slots, rows = block_table_rows(table, dirty, cfg, _bucket(len(dirty), cfg.request_buckets))
            state = _write_blocks(state, slots, rows)
        decode = self._decode_kernel and all(n == 1 for n in scheduled.values())
        last_hidden, hidden, state = _forward(self.params, state, token_inputs, model=self.model_config, uniform_decode=decode)
        out, state = _sample(self.params, state, last_hidden, sample_inputs, model=self.model_config, flags=flags)
        prompt_logprobs = self._score_prompts(table, order, scheduled, hidden)

        out = jax.device_get(out)
        self._table = table.after_sampling(scheduled, sampled)
        logprobs = {}
        for i, rid in enumerate(order):
            wanted = table.rows[rid].sampling.num_logprobs
            if rid in sampled and wanted >= 0:
                rows = LogprobsArrays(out.logprob_token_ids[i : i + 1], out.logprobs[i : i + 1], out.ranks[i : i + 1])
                logprobs[rid] = rows.select(slice(None), wanted)
        return state, RunnerOutput(
            req_ids=order,
            req_id_to_index={rid: i for i, rid in enumerate(order)},
            sampled_token_ids=[[int(out.tokens[i])] if rid in sampled else [] for i, rid in enumerate(order)],
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            num_nans_in_logits={rid: int(out.num_nans[i]) for i, rid in enumerate(order)},
        )

    def _score_prompts(
        self, table: RequestTable, order: list[str], scheduled: dict[str, int], hidden: jax.Array
    ) -> dict[str, LogprobsArrays]:
        """Prompt logprobs of this step's chunks; a request's whole prompt is returned once, when complete.

        The logits at position p score prompt token p + 1, so they come from the backbone's hidden
        states of this step's tokens; a resumed request (prompt + outputs as prefill) already had
        them and scores none.
        """
        wanting = []
        rows, targets = [], []
        start = 0
        for rid in order:
            row, n = table.rows[rid], scheduled[rid]
            resumed = len(row.prefill_token_ids) > row.prompt_len
            if row.sampling_params.prompt_logprobs is not None and row.num_computed < row.prompt_len and not resumed:
                positions = prompt_logprob_positions(row.prompt_len, len(row.prefill_token_ids), row.num_computed, n)
                wanting.append((rid, len(rows), len(positions)))
                rows += [start + p - row.num_computed for p in positions]
                targets += [row.prefill_token_ids[p + 1] for p in positions]
            start += n
        if not wanting:
            return {}
        mode = self.config.logprobs_mode
        parts = []
        for lo in range(0, max(len(rows), 1), PROMPT_LOGPROBS_CHUNK):
            chunk_rows = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
            chunk_targets = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
            chunk_rows[: len(rows[lo : lo + PROMPT_LOGPROBS_CHUNK])] = rows[lo : lo + PROMPT_LOGPROBS_CHUNK]
            chunk_targets[: len(targets[lo : lo + PROMPT_LOGPROBS_CHUNK])] = targets[lo : lo + PROMPT_LOGPROBS_CHUNK]
            values, ids, ranks = _prompt_logprobs(
                self.params, hidden, chunk_rows, chunk_targets, model=self.model_config,
                num_top=self.sampler_config.logprobs_width, as_logits=mode.endswith("logits"),
            )
            parts.append(LogprobsArrays(np.asarray(ids), np.asarray(values), np.asarray(ranks)))
        scored = LogprobsArrays.concat(parts)
        done = {}
        for rid, lo, count in wanting:
            row = table.rows[rid]
            num_top = row.sampling_params.prompt_logprobs
            part = scored.select(slice(lo, lo + count), self.sampler_config.vocab_size if num_top == -1 else num_top)
            complete = self._prompt_logprobs.add(rid, part, row.num_computed + scheduled[rid] >= row.prompt_len)
            if complete is not None:
                done[rid] = complete
        return done

    def warmup(self, state: RunnerState) -> tuple[RunnerState, dict]:
        """Compile every graph a step can use, so that serving never compiles: run each jitted function
        once per bucket (and sampler variant) on padding inputs, which leave the state unchanged.

        Returns the state and a start-up report (graphs, seconds, KV cache size).
        """
        cfg, sampler, model = self.config, self.sampler_config, self.model_config
        start, graphs = time.perf_counter(), 0
        decode_buckets = cfg.token_buckets[: bisect.bisect_left(cfg.token_buckets, cfg.max_num_seqs) + 1]
        for t in cfg.token_buckets:
            token_inputs = build_inputs(self._table, [], {}, cfg, sampler, t, 1)[0]
            for decode in sorted({False, self._decode_kernel and t in decode_buckets}):
                last_hidden, hidden, state = _forward(self.params, state, token_inputs, model=model, uniform_decode=decode)
                graphs += 1
            rows = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
            _prompt_logprobs(self.params, hidden, rows, rows, model=model, num_top=sampler.logprobs_width,
                             as_logits=cfg.logprobs_mode.endswith("logits"))
            graphs += 1
        for b in cfg.request_buckets:
            nowhere = np.full(b, cfg.max_num_seqs, np.int32)
            for flags in flag_variants(sampler):
                inputs = SampleInputs(nowhere, np.zeros(b, np.int32), neutral_metadata(b, sampler, flags))
                _, state = _sample(self.params, state, last_hidden, inputs, model=model, flags=flags)
                graphs += 1
            state = _write_blocks(state, nowhere, np.zeros((b, cfg.max_blocks_per_req), np.int32))
            graphs += 1
        jax.block_until_ready(state)
        return state, {
            "token_buckets": list(cfg.token_buckets),
            "request_buckets": list(cfg.request_buckets),
            "graphs": graphs,
            "compile_seconds": round(time.perf_counter() - start, 2),
            "kv_cache_blocks": cfg.num_blocks,
            "kv_cache_tokens": cfg.num_blocks * cfg.block_size,
            "kv_cache_gib": round(kv_cache_bytes(model, cfg) / 2**30, 3),
        }

    def compile_forward(self, state: RunnerState, num_tokens: int, uniform_decode: bool = False) -> jax.stages.Compiled:
        """The compiled backbone for the bucket holding `num_tokens` (its memory_analysis() proves no KV copy)."""
        t_bucket = _bucket(num_tokens, self.config.token_buckets)
        token_inputs, _, _, _ = build_inputs(self._table, [], {}, self.config, self.sampler_config, t_bucket, 1)
        return _forward.lower(self.params, state, token_inputs, model=self.model_config, uniform_decode=uniform_decode).compile()
