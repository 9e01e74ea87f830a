"""The model runner: `state, out = runner.step(state, sched)`.

One step, top to bottom:
  1. check the SchedulerOutput and build the next host request table, the step's padded arrays
     and, for prompt logprobs, the rows to score; until all of that stands nothing has changed, so
     a ValueError leaves the runner exactly as it was (random state included);
  2. on the device (state donated): write changed block-table rows (and the token rows of new
     requests whose prefix the prefix cache holds), run the backbone over the packed
     tokens with paged attention (`execute_model`), then logits and sampling for the batch's rows,
     and prompt logprobs for requests that ask for them (`sample_tokens`, which takes the
     structured requests' grammar masks: the host fills them while the backbone runs);
  3. advance the table, and hand back the output still in flight (`dispatch`: both halves) or read
     (`step`).
With `num_steps` > 1 (all decodes), step 2 runs that many forward + sample rounds in one call.
With speculative decoding, step 2 verifies each decode's drafts with the rejection sampler and
proposes the next ones on the device (`step.spec_sample_step`); the number of tokens each request
keeps comes back with its tokens.
Each device call is a program of `programs.py`, found by the key of its arguments. With
`tensor_parallel_size` > 1 the runner lays its params out for the split and places them and its
state on a mesh (`parallel`); every program then runs split over it, the step unchanged.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import Kernels, ModelConfig, RunnerConfig
from jaxrunner.runner.input_batch import (
    RequestTable,
    batch_order,
    block_table_rows,
    build_inputs,
    check_grammar_bitmask,
    prefill_rows,
    write_grammar_rows,
)
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.lora.adapters import Adapters
from jaxrunner.lora_request import LoRARequest
from jaxrunner.models.llama import Params, param_specs
from jaxrunner.lora.slots import init_lora
from jaxrunner.runner.parallel import check_split, make_mesh, place, shard_layout, sharded_config
from jaxrunner.runner.pending_output import PendingOutput
from jaxrunner.runner.programs import (
    DECODE_LOOP,
    FORWARD,
    PROMPT_LOGPROBS,
    PROMPT_LOGPROBS_CHUNK,
    SAMPLE,
    SPEC_SAMPLE,
    WRITE_BLOCKS,
    WRITE_LORA,
    WRITE_TOKENS,
    Context,
    bucket,
    shared_programs,
)
from jaxrunner.sampling import (
    PromptLogprobsBuffer,
    SamplerFlags,
    SamplerOutput,
    mask_words,
    prepare_request,
    prompt_logprob_positions,
)
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.runner.state import RunnerState, init_state, kv_cache_bytes
from jaxrunner.runner.step import SampleInputs, TokenInputs, decode_round
from jaxrunner.step_io import LogprobsArrays, RunnerOutput, SchedulerOutput

# Per request wanting prompt logprobs from a step: (request id, its rows among the step's tokens,
# the prompt tokens those rows score).
Scoring = list[tuple[str, list[int], list[int]]]


@dataclass(frozen=True)
class _Forwarded:
    """A step whose forward pass is queued, waiting for `sample_tokens`; `table` is the request
    table before the step (prompt logprobs read its progress)."""

    sched: SchedulerOutput
    table: RequestTable
    order: list[str]
    steps: dict[str, int]
    num_top: dict[str, int]
    scoring: Scoring
    last_hidden: jax.Array
    hidden: jax.Array
    samples: SampleInputs
    flags: SamplerFlags


def _draft_fits(target: ModelConfig, draft: ModelConfig) -> bool:
    """Whether the draft's layers can read the blocks the target's one group keeps."""
    if len(target.kv_cache_groups) != 1 or len(draft.kv_cache_groups) != 1:
        return False
    (window,), (draft_window,) = target.group_windows, draft.group_windows
    return window is None or draft_window is not None and draft_window <= window


class Runner:
    """`draft`: the draft model's (config, params), for speculative decoding with method "draft_model"."""

    def __init__(
        self, model_config: ModelConfig, params: Params, config: RunnerConfig = RunnerConfig(),
        draft: tuple[ModelConfig, Params] | None = None,
    ) -> None:
        spec = config.speculative
        if (spec.enabled and spec.method == "draft_model") != (draft is not None):
            raise ValueError("a draft model goes with speculative decoding of method 'draft_model', and that needs one: "
                             "pass draft=(config, params)")
        if draft is not None and draft[0].vocab_size != model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft[0].vocab_size} tokens) differs from the target's "
                             f"({model_config.vocab_size}); speculative decoding needs the same tokenizer")
        if draft is not None and not _draft_fits(model_config, draft[0]):
            raise ValueError(f"a draft model reads the target's block table, so both need one KV-cache group and the "
                             f"draft a window no wider than the target's; the target has {len(model_config.kv_cache_groups)} "
                             f"groups (window {model_config.sliding_window}), the draft {len(draft[0].kv_cache_groups)} "
                             f"(window {draft[0].sliding_window}); use ngram speculation for this model")
        if config.lora.enabled and model_config.num_experts:
            raise ValueError(f"LoRA adapters on Mixture-of-Experts models ({model_config.architecture}) are not "
                             "supported yet; run without enable_lora")
        tp, replica = config.tensor_parallel_size, config.data_parallel_rank
        self.mesh = make_mesh(tp, replica) if tp > 1 or replica > 0 else None
        if tp > 1:  # the params laid out for the split
            check_split(model_config, tp)
            params = shard_layout(params, model_config, tp)
            model_config = sharded_config(model_config, tp)
        if self.mesh is not None:
            params = place(params, param_specs(model_config), self.mesh)
        self.model_config = model_config
        self.config = config
        self.params = params
        self.draft_model, self.draft_params = draft if draft is not None else (None, {})
        self.kernels = Kernels.choose(config.kernels)
        self.ctx = Context(model_config, config, self.kernels, str(params["embed"].dtype), self.draft_model, self.mesh)
        self.programs = shared_programs(self.ctx)
        self.lora = init_lora(model_config, config.lora, self.ctx.dtype)  # the adapter slots (() without LoRA)
        self.adapters = Adapters(model_config, config.lora)
        self._table = RequestTable.empty(config.max_num_seqs)
        self._prompt_logprobs = PromptLogprobsBuffer()
        self._rng = np.random.default_rng(config.seed)
        self._forwarded: _Forwarded | PendingOutput | None = None  # a step between execute_model and sample_tokens
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(config.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, config: RunnerConfig = RunnerConfig()) -> Runner:
        model_config, params = load_model(path, config.dtype)
        return cls(model_config, params, config)

    def init_state(self) -> RunnerState:
        """Zeros, made where they live (split over the mesh under tensor parallelism)."""
        make = functools.partial(init_state, self.model_config, self.config, self.draft_model)
        if self.mesh is None:
            return make()
        return jax.jit(make, out_shardings=jax.tree.map(lambda s: s.sharding, self.ctx.state))()

    def check_sampling_params(self, params: SamplingParams, prompt_len: int = 0) -> None:
        """Raise a ValueError for parameters this model or runner rules out (token ids, logprob counts)."""
        model = self.model_config
        prepare_request(params, 0, prompt_len, self.config.sampler, model.vocab_size, model.eos_token_ids)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (it loads into a device slot when a step needs it); a
        ValueError names what is wrong with it."""
        self.adapters.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.adapters.remove(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.adapters.requests()

    def step(self, state: RunnerState, sched: SchedulerOutput) -> tuple[RunnerState, RunnerOutput]:
        """Run one scheduled batch and wait for its output."""
        state, pending = self.dispatch(state, sched)
        return state, pending.get()

    def dispatch(self, state: RunnerState, sched: SchedulerOutput) -> tuple[RunnerState, PendingOutput]:
        """Queue one scheduled batch on the device and return without waiting for it: `execute_model`,
        then `sample_tokens` with the grammar masks `sched` carries.

        Sampled tokens stay on the device and feed later steps, so the next step can be dispatched
        before this one's output reaches the host (its copy starts at once). Prompt logprobs are the
        exception: a step that completes them waits for them.
        """
        check_grammar_bitmask(sched, sched.grammar_bitmask, self.model_config.vocab_size)
        return self.sample_tokens(self.execute_model(state, sched), sched.grammar_bitmask)

    def execute_model(self, state: RunnerState, sched: SchedulerOutput) -> RunnerState:
        """Check `sched` and queue its forward pass (a multi-step decode whole); `sample_tokens` then
        samples. Between the two, the host can fill the step's grammar masks while the device runs
        the model (vLLM's execute_model / sample_tokens). A ValueError leaves the runner as it was."""
        if self._forwarded is not None:
            raise RuntimeError("the last step's forward pass is waiting for its sampling: call sample_tokens first")
        cfg, model, ctx = self.config, self.model_config, self.ctx
        rng = copy.deepcopy(self._rng)  # seeds are drawn from a copy, kept only if the step stands
        for new in sched.scheduled_new_reqs:
            if new.lora_request is not None:
                self.adapters.add(new.lora_request)
        table, dirty = self._table.apply(sched, cfg, model, rng)
        order = batch_order(sched)
        lora_ids = {table.rows[rid].lora_id for rid in order} - {0}
        if len(lora_ids) > cfg.lora.max_loras:
            raise ValueError(f"SchedulerOutput rejected: the step uses {len(lora_ids)} LoRA adapters, more than "
                             f"max_loras={cfg.lora.max_loras}")
        scheduled = sched.num_scheduled_tokens
        if order:
            b_bucket = bucket(len(order), cfg.request_buckets)
            t_bucket = bucket(sched.total_num_scheduled_tokens, cfg.token_buckets)
            masks_per_row = 1 + ctx.spec_tokens
            masks = (np.broadcast_to(np.int32(-1), (len(order), masks_per_row * mask_words(model.vocab_size)))
                     if sched.structured_output_request_ids else None)  # all allowed until sample_tokens writes them
            slot_values, writes = self.adapters.activate(lora_ids) if lora_ids else ({}, [])
            lora_slots = {rid: slot_values[table.rows[rid].lora_id] for rid in order if table.rows[rid].lora_id}
            tokens, samples, flags, sampled = build_inputs(table, order, scheduled, cfg, model.vocab_size, t_bucket,
                                                           b_bucket, sched.scheduled_spec_decode_tokens, masks, lora_slots)
            blocks = block_table_rows(table, dirty, cfg, bucket(len(dirty), cfg.request_buckets)) if dirty else None
            hits = [n.req_id for n in sched.scheduled_new_reqs if n.num_computed_tokens]  # prefix-cache hits
            prefills = prefill_rows(table, hits, cfg, bucket(len(hits), cfg.request_buckets)) if hits else None
            if sched.num_steps == 1:  # the most tokens each request can keep: 1 + its drafts
                steps = {rid: 1 + table.num_drafts(rid, sched) for rid in sampled}
                scoring = self._prompts_to_score(table, order, scheduled)
            else:
                steps = {rid: table.decode_steps(rid, sched.num_steps, cfg.max_model_len) for rid in order}
                counts = np.zeros(b_bucket, np.int32)
                counts[: len(order)] = [steps[rid] for rid in order]
        self._rng = rng
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self._prompt_logprobs.discard(rid)
        if not order:
            self._table = table
            self._forwarded = PendingOutput([], {}, {}, None, {})
            return state

        for slot, adapter in writes:
            tensors = adapter.slot_tensors(model, cfg.lora.max_lora_rank, jnp.dtype(ctx.dtype))
            self.lora = self.programs.run(WRITE_LORA, self.lora, np.int32(slot), tensors)
        if blocks is not None:
            state = self.programs.run(WRITE_BLOCKS, state, *blocks)
        if prefills is not None:
            state = self.programs.run(WRITE_TOKENS, state, *prefills)
        decode = ctx.uniform_decode(scheduled)
        num_top = {rid: table.rows[rid].sampling.num_logprobs for rid in order}
        if sched.num_steps == 1:
            last_hidden, hidden, state = self.programs.run(FORWARD, self.params, self.draft_params, self.lora, state,
                                                           tokens, uniform_decode=decode)
            self._forwarded = _Forwarded(sched, table, order, steps, num_top, scoring, last_hidden, hidden, samples, flags)
            self._table = table.advance(scheduled, steps)
        else:
            out, state = self._decode(state, tokens, samples, counts, flags, sched.num_steps, decode)
            self._forwarded = self._pending(order, steps, num_top, out, {})
            self._table = table.advance(steps, steps)
        return state

    def sample_tokens(
        self, state: RunnerState, grammar_bitmask: np.ndarray | None = None
    ) -> tuple[RunnerState, PendingOutput]:
        """Sample the step `execute_model` queued, with its structured requests' grammar masks
        (`SchedulerOutput.grammar_bitmask`'s layout), and return its output on its way. A ValueError
        (bad masks) leaves the step waiting for good ones."""
        fwd = self._forwarded
        if fwd is None:
            raise RuntimeError("no step to sample: call execute_model first")
        if isinstance(fwd, PendingOutput):  # an empty step or a multi-step decode: sampled already
            if grammar_bitmask is not None:
                raise ValueError("grammar_bitmask given for a step with no structured request that samples one token")
            self._forwarded = None
            return state, fwd
        check_grammar_bitmask(fwd.sched, grammar_bitmask, self.model_config.vocab_size)
        samples = fwd.samples
        if grammar_bitmask is not None:
            write_grammar_rows(samples.sampling.grammar_bitmask, fwd.order, fwd.sched, grammar_bitmask, 1 + self.ctx.spec_tokens)
        self._forwarded = None
        num_kept = drafts = None
        if self.ctx.spec_tokens:
            out, num_kept, drafts, state = self.programs.run(SPEC_SAMPLE, self.params, self.draft_params, state,
                                                             fwd.last_hidden, samples, flags=fwd.flags)
        else:
            out, state = self.programs.run(SAMPLE, self.params, state, fwd.last_hidden, samples, flags=fwd.flags)
        prompt_logprobs = self._score_prompts(fwd.table, fwd.scoring, fwd.sched.num_scheduled_tokens, fwd.hidden)
        return state, self._pending(fwd.order, fwd.steps, fwd.num_top, out, prompt_logprobs, num_kept, drafts)

    @staticmethod
    def _pending(order: list[str], steps: dict[str, int], num_top: dict[str, int], out: SamplerOutput,
                 prompt_logprobs: dict, num_kept: jax.Array | None = None, drafts: jax.Array | None = None) -> PendingOutput:
        for leaf in jax.tree.leaves((out, num_kept, drafts)):
            leaf.copy_to_host_async()
        return PendingOutput(order, steps, num_top, out, prompt_logprobs, num_kept, drafts)

    def _decode(
        self, state: RunnerState, tokens: TokenInputs, samples: SampleInputs, counts: np.ndarray,
        flags: SamplerFlags, num_steps: int, decode: bool,
    ) -> tuple[SamplerOutput, RunnerState]:
        """Multi-step decode: in one call for plain sampling (`Context.loops`), else its rounds one
        by one through the single-step programs (same rounds, more dispatches)."""
        if self.ctx.loops(flags):
            return self.programs.run(DECODE_LOOP, self.params, self.lora, state, tokens, samples, counts, flags=flags,
                                     num_steps=num_steps, uniform_decode=decode)
        outs = []
        for j in range(num_steps):
            tok, smp = decode_round(tokens, samples, counts, j, self.config.max_num_seqs)
            last_hidden, _, state = self.programs.run(FORWARD, self.params, self.draft_params, self.lora, state, tok,
                                                      uniform_decode=decode)
            out, state = self.programs.run(SAMPLE, self.params, state, last_hidden, smp, flags=flags)
            outs.append(out)
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs), state

    def _prompts_to_score(self, table: RequestTable, order: list[str], scheduled: dict[str, int]) -> Scoring:
        """The rows of this step's tokens whose logits score prompt tokens, per request that wants
        prompt logprobs.

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
        self, table: RequestTable, wanting: Scoring, scheduled: dict[str, int], hidden: jax.Array
    ) -> dict[str, LogprobsArrays]:
        """Prompt logprobs of this step's chunks; a request's whole prompt is returned once, when complete."""
        if not wanting:
            return {}
        rows = [r for _, part, _ in wanting for r in part]
        targets = [t for _, _, part in wanting for t in part]
        parts = []
        for lo in range(0, max(len(rows), 1), PROMPT_LOGPROBS_CHUNK):  # one call even for no rows: `scored` needs its columns
            chunk_rows, chunk_targets = (np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32) for _ in range(2))
            n = len(rows[lo : lo + PROMPT_LOGPROBS_CHUNK])
            chunk_rows[:n], chunk_targets[:n] = rows[lo : lo + n], targets[lo : lo + n]
            values, ids, ranks = self.programs.run(PROMPT_LOGPROBS, self.params, hidden, chunk_rows, chunk_targets)
            parts.append(LogprobsArrays(np.asarray(ids)[:n], np.asarray(values)[:n], np.asarray(ranks)[:n]))
        done, lo = {}, 0
        scored = LogprobsArrays.concat(parts)
        for rid, part, _ in wanting:
            row = table.rows[rid]
            num_top = row.sampling_params.prompt_logprobs
            chunk = scored.select(slice(lo, lo + len(part)), self.model_config.vocab_size if num_top == -1 else num_top)
            lo += len(part)
            complete = self._prompt_logprobs.add(rid, chunk, row.num_computed + scheduled[rid] >= row.prompt_len)
            if complete is not None:
                done[rid] = complete
        return done

    def warmup(self) -> dict:
        """Compile, in parallel, every program a step can run (`Programs.warm_up`): serving then
        never compiles. Returns a start-up report (programs, seconds, KV cache size)."""
        cfg = self.config
        start, lowering, loaded = time.perf_counter(), self.programs.lowering_seconds, self.programs.loaded
        programs, compiled = self.programs.warm_up()
        return {
            "token_buckets": list(cfg.token_buckets),
            "request_buckets": list(cfg.request_buckets),
            "programs": programs,
            "compiled": compiled,  # the others were compiled already, by a runner of the same context
            "compile_seconds": round(time.perf_counter() - start, 2),
            "lowering_seconds": round(self.programs.lowering_seconds - lowering, 2),
            "loaded_from_cache": self.programs.loaded - loaded,  # of `compiled`: read from the program cache
            "kv_cache_blocks": cfg.num_blocks,
            "kv_cache_tokens": cfg.num_blocks * cfg.block_size,
            "kv_cache_gib": round(kv_cache_bytes(self.model_config, cfg) / 2**30, 3),
        }

    def peak_step_bytes(self) -> int:
        """Temporary device memory of the largest step (the largest token bucket's backbone, then the
        fullest sampler at the largest request bucket), from their compiled executables: a profiling
        compile that needs no cache allocated (the cache is aliased, so its size changes nothing)."""
        ctx = self.ctx
        flags, b = ctx.sampler_variants[-1], self.config.request_buckets[-1]
        if ctx.spec_tokens:
            sampler = self.programs.program(SPEC_SAMPLE, ctx.params, ctx.draft_params, ctx.state, ctx.last_hidden(),
                                            ctx.samples(b, flags), flags=flags)
        else:
            sampler = self.programs.program(SAMPLE, ctx.params, ctx.state, ctx.last_hidden(), ctx.samples(b, flags),
                                            flags=flags)
        executables = [self.compile_forward(self.config.max_num_batched_tokens), self.programs.executable(sampler)]
        return max(exe.memory_analysis().temp_size_in_bytes for exe in executables)

    def compile_forward(self, num_tokens: int, uniform_decode: bool = False) -> jax.stages.Compiled:
        """The compiled backbone for the bucket holding `num_tokens` (its memory_analysis() proves no KV copy)."""
        ctx = self.ctx
        tokens = ctx.tokens(bucket(num_tokens, self.config.token_buckets))
        return self.programs.executable(self.programs.program(FORWARD, ctx.params, ctx.draft_params, ctx.lora, ctx.state,
                                                              tokens, uniform_decode=uniform_decode))
