"""The model runner: `state, out = runner.step(state, sched)`.

One step, top to bottom:
  1. check the SchedulerOutput and build the next host request table (a ValueError changes nothing);
  2. pad the batch to a token bucket and a request bucket and build the step's arrays;
  3. on the device (state donated): write changed block-table rows, run the backbone over the packed
     tokens with paged attention, then logits and sampling for the batch's rows (and prompt
     logprobs for requests that ask for them);
  4. advance the table, and hand back the output still in flight (`dispatch`) or read (`step`).
With `num_steps` > 1 (all decodes), step 3 runs that many forward + sample rounds in one call.
"""

from __future__ import annotations

import bisect
import copy
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.input_batch import RequestTable, SampleInputs, TokenInputs, batch_order, block_table_rows, build_inputs
from jaxrunner.loader import load_model
from jaxrunner.models.llama import Params
from jaxrunner.program_cache import ProgramCache
from jaxrunner.programs import Program, Programs
from jaxrunner.sampling import (
    LogprobsArrays,
    PromptLogprobsBuffer,
    SamplerConfig,
    SamplerFlags,
    SamplerOutput,
    flag_variants,
    neutral_metadata,
    prepare_request,
    prompt_logprob_positions,
)
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.state import RunnerState, init_state, kv_cache_bytes
from jaxrunner.step import decode_loop, decode_round, forward_step, prompt_logprobs_step, sample_step, write_block_rows
from jaxrunner.step_io import PendingOutput, RunnerOutput, SchedulerOutput


# The device functions; each runner compiles its own executables of them (see `programs`).
_write_blocks = jax.jit(write_block_rows, donate_argnums=0)
_forward = jax.jit(forward_step, static_argnames=("model", "uniform_decode"), donate_argnums=1)
_sample = jax.jit(sample_step, static_argnames=("model", "flags"), donate_argnums=1)
_decode_loop = jax.jit(decode_loop, static_argnames=("model", "flags", "num_steps", "uniform_decode"), donate_argnums=1)
_prompt_logprobs = jax.jit(prompt_logprobs_step, static_argnames=("model", "num_top", "as_logits"))

# Prompt positions scored per device call: bounds the [rows, vocab] logits of long prompts.
PROMPT_LOGPROBS_CHUNK = 256


@functools.cache
def _shared_programs(model: ModelConfig, config: RunnerConfig, dtype: str) -> Programs:
    """Runners of one model shape, configuration and dtype run the same executables, so they share them."""
    cache_dir = config.compilation_cache_dir
    return Programs(ProgramCache(os.path.join(cache_dir, "programs")) if cache_dir else None)


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
            max_bad_word_len=config.max_bad_word_len,
            eos_token_ids=model_config.eos_token_ids,
        )
        self._table = RequestTable.empty(config.max_num_seqs)
        self._prompt_logprobs = PromptLogprobsBuffer()
        self._rng = np.random.default_rng(config.seed)
        # Only GPUs have a decode-specialised attention kernel; elsewhere one graph per bucket does.
        self._decode_kernel = jax.default_backend() == "gpu"
        self._warm = False  # after `warmup`, a missing multi-step program is not compiled
        self.programs = _shared_programs(model_config, config, str(params["embed"].dtype))
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
        """Run one scheduled batch and wait for its output."""
        state, pending = self.dispatch(state, sched)
        return state, pending.get()

    def dispatch(self, state: RunnerState, sched: SchedulerOutput) -> tuple[RunnerState, PendingOutput]:
        """Queue one scheduled batch on the device and return without waiting for it.

        Sampled tokens stay on the device and feed later steps, so the next step can be dispatched
        before this one's output reaches the host (its copy starts at once). Prompt logprobs are the
        exception: a step that completes them waits for them.
        """
        cfg = self.config
        # Everything that can reject `sched` runs before the runner changes: a draw from a copy of
        # the random state, host arrays built, then the commit and the device calls.
        rng = copy.deepcopy(self._rng)
        table, dirty = self._table.apply(sched, cfg, self.sampler_config, rng)
        order = batch_order(table, sched)
        scheduled = sched.num_scheduled_tokens
        if order:
            t_bucket = _bucket(sched.total_num_scheduled_tokens, cfg.token_buckets)
            b_bucket = _bucket(len(order), cfg.request_buckets)
            token_inputs, sample_inputs, flags, sampled = build_inputs(
                table, order, scheduled, cfg, self.sampler_config, t_bucket, b_bucket
            )
            blocks = block_table_rows(table, dirty, cfg, _bucket(len(dirty), cfg.request_buckets)) if dirty else None
            scoring = self._prompts_to_score(table, order, scheduled) if sched.num_steps == 1 else []
        self._rng = rng
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self._prompt_logprobs.discard(rid)
        if not order:
            self._table = table
            return state, PendingOutput([], {}, {}, {}, None, {})

        if blocks is not None:
            state = self.programs.run(self._write_blocks_program(state, *blocks))
        decode = self._decode_kernel and all(n == 1 for n in scheduled.values())
        if sched.num_steps == 1:
            steps = dict.fromkeys(sampled, 1)
            last_hidden, hidden, state = self.programs.run(self._forward_program(state, token_inputs, decode))
            out, state = self.programs.run(self._sample_program(state, last_hidden, sample_inputs, flags))
            prompt_logprobs = self._score_prompts(table, scoring, scheduled, hidden)
            self._table = table.advance(scheduled, steps)
        else:
            steps = {rid: table.decode_steps(rid, sched.num_steps, cfg.max_model_len) for rid in order}
            counts = np.zeros(b_bucket, np.int32)
            counts[: len(order)] = [steps[rid] for rid in order]
            out, state = self._decode(state, token_inputs, sample_inputs, counts, flags, sched.num_steps, decode)
            prompt_logprobs = {}
            self._table = table.advance(steps, steps)
        for leaf in jax.tree.leaves(out):
            leaf.copy_to_host_async()
        rows = [table.rows[rid] for rid in order]
        return state, PendingOutput(
            req_ids=order,
            steps=steps,
            stop_ids={row.req_id: self._stop_ids(row.sampling_params) for row in rows},
            num_top={row.req_id: row.sampling.num_logprobs for row in rows},
            sampled=out,
            prompt_logprobs=prompt_logprobs,
        )

    def _decode(
        self, state: RunnerState, tokens: TokenInputs, inputs: SampleInputs, counts: np.ndarray,
        flags: SamplerFlags, num_steps: int, decode: bool,
    ) -> tuple[SamplerOutput, RunnerState]:
        """Multi-step decode in one call; or, once warmed up, round by round through the single-step
        programs when the warm-up compiled no loop for these flags (same rounds, more dispatches)."""
        loop = self._decode_loop_program(state, tokens, inputs, counts, flags, num_steps, decode)
        if not self._warm or loop.key in self.programs:
            return self.programs.run(loop)
        outs = []
        for j in range(num_steps):
            tok, smp = decode_round(tokens, inputs, counts, j, self.config.max_num_seqs)
            last_hidden, _, state = self.programs.run(self._forward_program(state, tok, decode))
            out, state = self.programs.run(self._sample_program(state, last_hidden, smp, flags))
            outs.append(out)
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs), state

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = () if params.ignore_eos else self.sampler_config.eos_token_ids
        return frozenset((*eos, *(params.stop_token_ids or ())))

    def _prompts_to_score(
        self, table: RequestTable, order: list[str], scheduled: dict[str, int]
    ) -> list[tuple[str, list[int], list[int]]]:
        """Per request that wants prompt logprobs from this step's chunk: its rows among the step's
        tokens and the prompt tokens they score.

        The logits at position p score prompt token p + 1, so they come from the backbone's hidden
        states of this step's tokens; a resumed request (prompt + outputs as prefill) already had
        them and scores none.
        """
        wanting, start = [], 0
        for rid in order:
            row, n = table.rows[rid], scheduled[rid]
            resumed = len(row.prefill_token_ids) > row.prompt_len
            if row.sampling_params.prompt_logprobs is not None and row.num_computed < row.prompt_len and not resumed:
                positions = prompt_logprob_positions(row.prompt_len, len(row.prefill_token_ids), row.num_computed, n)
                wanting.append((rid, [start + p - row.num_computed for p in positions],
                                [row.prefill_token_ids[p + 1] for p in positions]))
            start += n
        return wanting

    def _score_prompts(
        self, table: RequestTable, wanting: list[tuple[str, list[int], list[int]]], scheduled: dict[str, int],
        hidden: jax.Array,
    ) -> dict[str, LogprobsArrays]:
        """Prompt logprobs of this step's chunks; a request's whole prompt is returned once, when complete."""
        if not wanting:
            return {}
        rows = [r for _, part, _ in wanting for r in part]
        targets = [t for _, _, part in wanting for t in part]
        parts = []
        for lo in range(0, max(len(rows), 1), PROMPT_LOGPROBS_CHUNK):
            chunk_rows = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
            chunk_targets = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
            chunk_rows[: len(rows[lo : lo + PROMPT_LOGPROBS_CHUNK])] = rows[lo : lo + PROMPT_LOGPROBS_CHUNK]
            chunk_targets[: len(targets[lo : lo + PROMPT_LOGPROBS_CHUNK])] = targets[lo : lo + PROMPT_LOGPROBS_CHUNK]
            values, ids, ranks = self.programs.run(self._prompt_logprobs_program(hidden, chunk_rows, chunk_targets))
            parts.append(LogprobsArrays(np.asarray(ids), np.asarray(values), np.asarray(ranks)))
        scored = LogprobsArrays.concat(parts)
        done, lo = {}, 0
        for rid, part, _ in wanting:
            row = table.rows[rid]
            num_top = row.sampling_params.prompt_logprobs
            chunk = scored.select(slice(lo, lo + len(part)), self.sampler_config.vocab_size if num_top == -1 else num_top)
            lo += len(part)
            complete = self._prompt_logprobs.add(rid, chunk, row.num_computed + scheduled[rid] >= row.prompt_len)
            if complete is not None:
                done[rid] = complete
        return done

    # The programs a step runs, keyed by what makes their executables differ.
    def _forward_program(self, state: RunnerState, tokens: TokenInputs, decode: bool) -> Program:
        return Program(("forward", tokens.token_ids.shape[0], decode), _forward, (self.params, state, tokens),
                       dict(model=self.model_config, uniform_decode=decode))

    def _sample_program(self, state: RunnerState, last_hidden: jax.Array, inputs: SampleInputs, flags: SamplerFlags) -> Program:
        return Program(("sample", inputs.commit_rows.shape[0], flags), _sample, (self.params, state, last_hidden, inputs),
                       dict(model=self.model_config, flags=flags))

    def _decode_loop_program(
        self, state: RunnerState, tokens: TokenInputs, inputs: SampleInputs, counts: np.ndarray,
        flags: SamplerFlags, num_steps: int, decode: bool,
    ) -> Program:
        key = ("decode_loop", tokens.token_ids.shape[0], inputs.commit_rows.shape[0], flags, num_steps, decode)
        return Program(key, _decode_loop, (self.params, state, tokens, inputs, counts),
                       dict(model=self.model_config, flags=flags, num_steps=num_steps, uniform_decode=decode))

    def _write_blocks_program(self, state: RunnerState, slots: np.ndarray, rows: np.ndarray) -> Program:
        return Program(("write_blocks", slots.shape[0]), _write_blocks, (state, slots, rows), {})

    def _prompt_logprobs_program(self, hidden: jax.Array, rows: np.ndarray, targets: np.ndarray) -> Program:
        return Program(("prompt_logprobs", hidden.shape[0]), _prompt_logprobs, (self.params, hidden, rows, targets),
                       dict(model=self.model_config, num_top=self.sampler_config.logprobs_width,
                            as_logits=self.config.logprobs_mode.endswith("logits")))

    def warmup(self, state: RunnerState, num_steps: int = 1) -> dict:
        """Compile, in parallel, every program a step can run (`warmup_programs`): serving then never
        compiles. Returns a start-up report (programs, seconds, KV cache size)."""
        cfg = self.config
        start, lowering, loaded = time.perf_counter(), self.programs.lowering_seconds, self.programs.loaded
        programs = self.warmup_programs(state, num_steps)
        compiled = self.programs.compile_all(programs)
        self._warm = True
        return {
            "token_buckets": list(cfg.token_buckets),
            "request_buckets": list(cfg.request_buckets),
            "programs": len(programs),
            "compiled": compiled,  # the others were compiled already, by a runner of the same configuration
            "compile_seconds": round(time.perf_counter() - start, 2),
            "lowering_seconds": round(self.programs.lowering_seconds - lowering, 2),
            "loaded_from_cache": self.programs.loaded - loaded,  # of `compiled`: read from the program cache
            "kv_cache_blocks": cfg.num_blocks,
            "kv_cache_tokens": cfg.num_blocks * cfg.block_size,
            "kv_cache_gib": round(kv_cache_bytes(self.model_config, cfg) / 2**30, 3),
        }

    def warmup_programs(self, state: RunnerState, num_steps: int = 1) -> list[Program]:
        """Every program a step can run, slowest compiles first: the backbone per token bucket (and its
        decode form), with `num_steps` > 1 the multi-step decode per request bucket for plain
        sampling (temperature, seeds, logprobs; other batches run its rounds through the single-step
        programs), then the sampler per request bucket and variant, block writes, prompt logprobs."""
        cfg, sampler = self.config, self.sampler_config
        hidden = jax.ShapeDtypeStruct((cfg.max_num_seqs, self.model_config.hidden_size), cfg.jnp_dtype)
        empty = RequestTable.empty(cfg.max_num_seqs)
        models, rest = [], []  # whole-model programs compile slowest: they reach the pool first
        for t in reversed(cfg.token_buckets):
            tokens = build_inputs(empty, [], {}, cfg, sampler, t, 1)[0]
            models += [self._forward_program(state, tokens, decode) for decode in self._backbone_forms(t)]
            rows = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
            rest.append(self._prompt_logprobs_program(jax.ShapeDtypeStruct((t, hidden.shape[1]), hidden.dtype), rows, rows))
        for b in reversed(cfg.request_buckets):
            nowhere = np.full(b, cfg.max_num_seqs, np.int32)
            rest.append(self._write_blocks_program(state, nowhere, np.zeros((b, cfg.max_blocks_per_req), np.int32)))
            tokens = build_inputs(empty, [], {}, cfg, sampler, _bucket(b, cfg.token_buckets), b)[0]
            for flags in flag_variants(sampler):
                inputs = SampleInputs(nowhere, np.zeros(b, np.int32), neutral_metadata(b, sampler, flags))
                rest.append(self._sample_program(state, hidden, inputs, flags))
                if num_steps > 1 and flags in flag_variants(sampler)[:2]:
                    counts = np.zeros(b, np.int32)
                    models.append(self._decode_loop_program(state, tokens, inputs, counts, flags, num_steps, self._decode_kernel))
        return models + rest

    def _backbone_forms(self, t_bucket: int) -> list[bool]:
        """Backbone executables of a token bucket: general, and decode-only where a decode batch can land."""
        decode_buckets = self.config.token_buckets[: bisect.bisect_left(self.config.token_buckets, self.config.max_num_seqs) + 1]
        return sorted({False, self._decode_kernel and t_bucket in decode_buckets})

    def peak_step_bytes(self) -> int:
        """Temporary device memory of the largest step (the largest token bucket's backbone, then the
        fullest sampler at the largest request bucket), from their compiled executables: a profiling
        compile that needs no cache allocated (the cache is aliased, so its size changes nothing)."""
        cfg, sampler = self.config, self.sampler_config
        state = jax.eval_shape(self.init_state)
        hidden = jax.ShapeDtypeStruct((cfg.max_num_seqs, self.model_config.hidden_size), cfg.jnp_dtype)
        b, flags = cfg.request_buckets[-1], flag_variants(sampler)[-1]
        inputs = SampleInputs(np.full(b, cfg.max_num_seqs, np.int32), np.zeros(b, np.int32), neutral_metadata(b, sampler, flags))
        executables = [
            self.compile_forward(state, cfg.max_num_batched_tokens),
            self.programs.get(self._sample_program(state, hidden, inputs, flags)),
        ]
        return max(exe.memory_analysis().temp_size_in_bytes for exe in executables)

    def compile_forward(self, state: RunnerState, num_tokens: int, uniform_decode: bool = False) -> jax.stages.Compiled:
        """The compiled backbone for the bucket holding `num_tokens` (its memory_analysis() proves no KV copy)."""
        t_bucket = _bucket(num_tokens, self.config.token_buckets)
        tokens = build_inputs(RequestTable.empty(self.config.max_num_seqs), [], {}, self.config, self.sampler_config, t_bucket, 1)[0]
        return self.programs.get(self._forward_program(state, tokens, uniform_decode))
