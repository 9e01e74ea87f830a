"""The model runner: `state, out = runner.step(state, sched)`.

One step, top to bottom:
  1. `plan.prepare`: check the SchedulerOutput and make the next host request table and the step's
     plan (padded arrays, rows to write, LoRA slots to load, prompt-logprob rows); until both stand
     nothing has changed, so a ValueError leaves the runner exactly as it was (random state included);
  2. `execute_model`, on the device (state donated): the host tier's arrived loads written, the
     step's loads started and its saves gathered (`host_kv`), the plan's row writes, then the
     backbone over the packed tokens with paged attention (a multi-step decode: all its rounds,
     sampling included);
  3. `sample_tokens`: the structured requests' grammar masks into the plan's buffer (the host fills
     them while the backbone runs), then logits and sampling for the batch's rows (with speculative
     decoding, `spec_decode.sample`: verify the drafts, keep 1 to k + 1 tokens, propose the next),
     and prompt logprobs for requests that ask for them; then the host tier's saves start while
     the device runs all that; the output is handed back in flight (`dispatch`) or read (`step`).
Each device call is a program of `programs.py`, found by the key of its named arguments. With
`tensor_parallel_size` > 1 the runner lays its params out for the split and places them and its
state on a mesh (`parallel`); every program then runs split over it, the step unchanged.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner import platform
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.config import Kernels, ModelConfig, RunnerConfig
from jaxrunner.lora.adapters import Adapters
from jaxrunner.lora.slots import init_lora
from jaxrunner.lora_request import LoRARequest
from jaxrunner.models.llama import Params, param_specs
from jaxrunner.runner.context import Context
from jaxrunner.runner.grammar_masks import check_masks, write_masks
from jaxrunner.runner.host_kv import HostKV
from jaxrunner.runner.input_batch import bucket
from jaxrunner.runner.memory import kv_cache_bytes
from jaxrunner.runner.parallel import make_mesh, place, shard_layout, sharded_config
from jaxrunner.runner.pending_output import PendingOutput
from jaxrunner.runner.plan import StepPlan, bucket_tiers, prepare, warmup_schedules
from jaxrunner.runner.programs import (
    DECODE_LOOP,
    FORWARD,
    KINDS,
    KV_FREE_KINDS,
    PROMPT_LOGPROBS,
    SAMPLE,
    SPEC_SAMPLE,
    WRITE_BLOCKS,
    WRITE_LORA,
    WRITE_TOKENS,
    Program,
    Programs,
    Progress,
    compile_report,
    shared_programs,
)
from jaxrunner.runner.request_table import RequestTable
from jaxrunner.runner.state import RunnerState, init_state
from jaxrunner.runner.step import decode_round
from jaxrunner.sampling import PromptLogprobsBuffer, SamplerOutput, prepare_request
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.step_io import RunnerOutput, SchedulerOutput, reject

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Forwarded:
    """A step whose forward pass is queued, waiting for `sample_tokens`: its plan, and the
    backbone's hidden states (each sequence's last 1 + k tokens', and every token's)."""

    plan: StepPlan
    last_hidden: jax.Array
    hidden: jax.Array


class Runner:
    """`draft`: the draft model's (config, params), for speculative decoding with method "draft_model"."""

    def __init__(
        self, model_config: ModelConfig, params: Params, config: RunnerConfig = RunnerConfig(),
        draft: tuple[ModelConfig, Params] | None = None,
    ) -> None:
        self.draft_model, self.draft_params = draft if draft is not None else (None, {})
        self.ctx = runner_context(model_config, config, str(params["embed"].dtype), self.draft_model)
        self.mesh, self.kernels = self.ctx.mesh, self.ctx.kernels
        if config.tensor_parallel_size > 1:  # the params laid out for the split
            params = shard_layout(params, model_config, config.tensor_parallel_size)
        if self.mesh is not None:
            params = place(params, param_specs(self.ctx.model), self.mesh)
        self.model_config = self.ctx.model
        self.config = config
        self.params = params
        self.programs = shared_programs(self.ctx)
        self._serving = self.ctx  # what steps are planned with: a background warm-up's tier meanwhile (`warmup`)
        self._warming: threading.Thread | None = None
        self._stop_warming = threading.Event()
        self.lora = init_lora(model_config, config.lora, self.ctx.dtype)  # the adapter slots (() without LoRA)
        self.adapters = Adapters(model_config, config.lora)
        self.host_kv = HostKV(self.ctx, self.programs) if config.num_host_blocks else None  # the host tier's pool
        self._table = RequestTable.empty(config.max_num_seqs)
        self._prompt_logprobs = PromptLogprobsBuffer()
        self._rng = np.random.default_rng(config.seed)
        self._forwarded: _Forwarded | PendingOutput | None = None  # a step between execute_model and sample_tokens
        if config.compilation_cache_dir:
            platform.use_compilation_cache(config.compilation_cache_dir)

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
        check_masks(sched, sched.grammar_bitmask, self.model_config.vocab_size)
        return self.sample_tokens(self.execute_model(state, sched), sched.grammar_bitmask)

    def execute_model(self, state: RunnerState, sched: SchedulerOutput) -> RunnerState:
        """Check `sched` and queue its forward pass (a multi-step decode whole); `sample_tokens` then
        samples. Between the two, the host can fill the step's grammar masks while the device runs
        the model (vLLM's execute_model / sample_tokens). A ValueError leaves the runner as it was."""
        if self._forwarded is not None:
            raise RuntimeError("the last step's forward pass is waiting for its sampling: call sample_tokens first")
        if self.host_kv is not None:
            self.host_kv.check(sched.kv_transfers)
        elif sched.kv_transfers:
            reject("kv_transfers given to a runner without a host tier (RunnerConfig.num_host_blocks=0)")
        # New requests' seeds are drawn from a copy, kept only if the step stands (no other step draws)
        rng = copy.deepcopy(self._rng) if sched.scheduled_new_reqs else self._rng
        self._table, plan = prepare(self._table, sched, self._serving, rng, self.adapters)
        self._rng = rng
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self._prompt_logprobs.discard(rid)
        if self.host_kv is not None:
            state = self.host_kv.transfer(state, sched.kv_transfers)
        if plan is None:
            self._forwarded = PendingOutput([], {}, {}, None, {})
            return state
        if not self.programs.warm:
            self.programs.compile_for_step(self._step_programs(plan))
        state = self._write_rows(state, plan)
        if sched.num_steps > 1:
            out, state = self._decode(state, plan)
            self._forwarded = self._pending(plan, out, {})
            return state
        last_hidden, hidden, state = self.programs.run(
            FORWARD, params=self.params, draft_params=self.draft_params, lora=self.lora, state=state,
            tokens=plan.tokens, uniform_decode=plan.uniform_decode)
        self._forwarded = _Forwarded(plan, last_hidden, hidden)
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
            self._start_copies()
            return state, fwd
        plan = fwd.plan
        check_masks(plan.sched, grammar_bitmask, self.model_config.vocab_size)
        if grammar_bitmask is not None:
            write_masks(plan.samples.sampling.grammar_bitmask, plan.order, plan.sched, grammar_bitmask,
                        self.ctx.queries_per_decode)
        self._forwarded = None
        named = dict(params=self.params, last_hidden=fwd.last_hidden, samples=plan.samples, flags=plan.flags)
        if self.ctx.spec_tokens:
            out, num_kept, drafts, state = self.programs.run(SPEC_SAMPLE, draft_params=self.draft_params, state=state,
                                                             **named)
        else:
            out, state, num_kept, drafts = *self._sample(state, **named), None, None
        prompt_logprobs = self._prompt_logprobs.score(plan.scoring, lambda rows, targets: self.programs.run(
            PROMPT_LOGPROBS, params=self.params, hidden=fwd.hidden, rows=rows, targets=targets),
            self.model_config.vocab_size)
        pending = self._pending(plan, out, prompt_logprobs, num_kept, drafts)
        self._start_copies()
        return state, pending

    def _start_copies(self) -> None:
        """The host tier's saves of the step just queued: the host starts them while the device runs
        it, after the step's output has started its way to the host (`_pending`), which would
        otherwise queue behind them."""
        if self.host_kv is not None:
            self.host_kv.start_copies()

    def _step_programs(self, plan: StepPlan) -> list[Program]:
        """The programs a step of `plan` calls, as `execute_model` and `sample_tokens` call them
        (warm-up's examples of that one plan), the slowest compiles first (`KINDS`' order): a
        multi-step decode's loop, or a single step's forward, sampler and prompt scoring; then its
        rows' writes. A multi-step decode that runs its rounds one by one, an adapter's slot write
        and the host tier's copies are left to their first call."""
        called = {WRITE_BLOCKS, WRITE_TOKENS}
        if plan.sched.num_steps > 1:
            called |= {DECODE_LOOP} if self.ctx.loops(plan.flags) else set()
        else:  # a sampler's kind has an example only where it runs (with drafts or without)
            called |= {FORWARD, SAMPLE, SPEC_SAMPLE} | ({PROMPT_LOGPROBS} if plan.scoring else set())
        return [p for kind in KINDS if kind in called for p in self.programs.examples(kind, [plan])]

    def _write_rows(self, state: RunnerState, plan: StepPlan) -> RunnerState:
        """Load the step's adapters into their slots, and its changed rows into the device tables."""
        for slot, adapter in plan.lora_writes:
            tensors = adapter.slot_tensors(self.model_config, self.config.lora.max_lora_rank, jnp.dtype(self.ctx.dtype))
            self.lora = self.programs.run(WRITE_LORA, lora=self.lora, slot=np.int32(slot), adapter=tensors)
        if plan.block_rows is not None:
            state = self.programs.run(WRITE_BLOCKS, state=state, slots=plan.block_rows.slots, rows=plan.block_rows.rows)
        if plan.token_rows is not None:
            state = self.programs.run(WRITE_TOKENS, state=state, slots=plan.token_rows.slots, rows=plan.token_rows.rows)
        return state

    @staticmethod
    def _pending(plan: StepPlan, out: SamplerOutput, prompt_logprobs: dict, num_kept: jax.Array | None = None,
                 drafts: jax.Array | None = None) -> PendingOutput:
        for leaf in jax.tree.leaves((out, num_kept, drafts)):
            leaf.copy_to_host_async()
        return PendingOutput(list(plan.order), plan.steps, plan.num_top, out, prompt_logprobs, num_kept, drafts)

    def _sample(self, state: RunnerState, **named) -> tuple[SamplerOutput, RunnerState]:
        out, token_ids = self.programs.run(SAMPLE, token_ids=state.token_ids, **named)
        return out, replace(state, token_ids=token_ids)

    def _decode(self, state: RunnerState, plan: StepPlan) -> tuple[SamplerOutput, RunnerState]:
        """Multi-step decode: in one call for plain sampling (`Context.loops`), else its rounds one
        by one through the single-step programs (same rounds, more dispatches)."""
        if self.ctx.loops(plan.flags):
            return self.programs.run(DECODE_LOOP, params=self.params, lora=self.lora, state=state, tokens=plan.tokens,
                                     samples=plan.samples, steps=plan.rounds, flags=plan.flags,
                                     num_steps=plan.sched.num_steps, uniform_decode=plan.uniform_decode)
        outs = []
        for j in range(plan.sched.num_steps):
            tokens, samples = decode_round(plan.tokens, plan.samples, plan.rounds, j, self.config.max_num_seqs)
            last_hidden, _, state = self.programs.run(FORWARD, params=self.params, draft_params=self.draft_params,
                                                      lora=self.lora, state=state, tokens=tokens,
                                                      uniform_decode=plan.uniform_decode)
            out, state = self._sample(state, params=self.params, last_hidden=last_hidden, samples=samples,
                                      flags=plan.flags)
            outs.append(out)
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs), state

    def warmup(self, progress: Progress = lambda done, total: None, background: bool = False) -> dict:
        """Compile, in parallel, every program a step can run (`Programs.warm_up`): serving then
        never compiles. Returns a start-up report (programs, seconds, KV cache size).
        `progress(done, total)` hears of each program ready.

        `background`: compile only the largest buckets' programs now (the first of
        `plan.bucket_tiers`) and return; a thread compiles the others tier by tier, and each step is
        planned with the buckets compiled so far (a batch pads up to the smallest of them), so a
        step still never compiles. `join_warmup` waits for the thread."""
        cfg = self.config
        programs = self.programs
        start, loaded = time.perf_counter(), programs.loaded
        lowering, tracing, by_kind = programs.lowering_seconds, programs.tracing_seconds, programs.lowering_by_kind.copy()
        compiled_before = set(programs.compile_seconds)
        tiers = bucket_tiers(self.ctx) if background else [self.ctx]
        everything = programs.warmup_programs()
        first = programs.warmup_programs(tiers[0]) if background else everything
        _, compiled = programs.warm_up(first, progress, len(everything))
        compiled_here = [p.key for p in first if p.key in programs.compile_seconds and p.key not in compiled_before]
        self._serving = tiers[0]
        if len(tiers) > 1:
            self._warming = threading.Thread(target=self._warm_up_tiers, args=(tiers[1:], progress, len(everything)),
                                             name="jaxrunner-warm-up", daemon=True)
            self._warming.start()
        return {
            "token_buckets": list(cfg.token_buckets),
            "request_buckets": list(cfg.request_buckets),
            "programs": len(everything),
            "compiled": compiled,  # the others were made already: by a runner of the same context, or read ahead
            "in_background": len(everything) - len(first),  # left to the warm-up thread, at most
            "compile_seconds": round(time.perf_counter() - start, 2),
            "lowering_seconds": round(programs.lowering_seconds - lowering, 2),
            "tracing_seconds": round(programs.tracing_seconds - tracing, 2),  # of lowering_seconds
            "lowering_seconds_by_kind": {kind: round(seconds, 2) for kind, seconds in (programs.lowering_by_kind - by_kind).items()},
            **compile_report({key: programs.compile_seconds[key] for key in compiled_here},
                             {key: programs.compile_ended[key] - start for key in compiled_here}),
            "loaded_from_cache": programs.loaded - loaded,  # of `compiled`: from the program cache or KV sizing
            "kv_cache_blocks": cfg.num_blocks,
            "kv_cache_tokens": cfg.num_blocks * cfg.block_size,
            "kv_cache_gib": round(kv_cache_bytes(self.model_config, cfg) / 2**30, 3),
        }

    def _warm_up_tiers(self, tiers: list[Context], progress: Progress, total: int) -> None:
        start = time.perf_counter()
        try:
            for tier in tiers:
                programs = self.programs.warmup_programs(tier)
                self.programs.warm_up(programs, progress, total, stop=self._stop_warming)
                if self._stop_warming.is_set():
                    return
                self._serving = tier  # the next step may use its buckets: all their programs are ready
        except Exception:  # serving goes on with the buckets compiled so far
            logger.exception("the background warm-up stopped; steps keep the buckets compiled so far: %s",
                             self._serving.config.token_buckets)
            return
        logger.info("background warm-up done in %.1f s: every bucket compiled", time.perf_counter() - start)

    def join_warmup(self, timeout: float | None = None) -> None:
        """Wait for a background warm-up (`warmup(background=True)`) to finish."""
        if self._warming is not None:
            self._warming.join(timeout)

    def run_each_once(self, state: RunnerState) -> RunnerState:
        """A fresh state, once every program a step of the buckets served now can run has run on
        warm-up's synthetic schedules (`plan.warmup_schedules`), and each of the host tier's copy
        programs (`HostKV.run_each_once`): after `warmup`, before the first step. A program's first
        run on a GPU holds the host for tens of milliseconds beyond later runs (its kernels load),
        which the first steps of serving would otherwise pay, between programs. Prompt logprobs' and
        LoRA slot writes' programs are left to their first use. The schedules wrote blocks and
        table rows that no request owns, so their state is dropped, and the request table and seed
        generator are as they were."""
        if self._table.rows or self._forwarded is not None:
            raise RuntimeError("run_each_once runs before the first step: this runner has requests")
        for sched in warmup_schedules(self._serving):
            self._table = RequestTable.empty(self.config.max_num_seqs)
            state, _ = self.dispatch(state, sched)
        if self.host_kv is not None:
            state = self.host_kv.run_each_once(state)
        self._table = RequestTable.empty(self.config.max_num_seqs)
        self._rng = np.random.default_rng(self.config.seed)
        jax.block_until_ready(state)
        del state  # its pages freed before the fresh state's are made
        return self.init_state()

    def stop_warmup(self) -> None:
        """End a background warm-up once the compiles it has started are done, and wait for that:
        a compile still running when the interpreter exits aborts the process. Steps keep the
        buckets compiled so far."""
        self._stop_warming.set()
        self.join_warmup()

    def peak_step_bytes(self) -> int:
        """Temporary device memory of this runner's largest step (`largest_step_bytes`)."""
        return largest_step_bytes(self.ctx)

    def compile_forward(self, num_tokens: int, uniform_decode: bool = False) -> jax.stages.Compiled:
        """The compiled backbone for the bucket holding `num_tokens` (its memory_analysis() proves no KV copy)."""
        return self.programs.executable(_forward_program(self.programs, num_tokens, uniform_decode))


def runner_context(model_config: ModelConfig, config: RunnerConfig, dtype: str,
                   draft_model: ModelConfig | None = None) -> Context:
    """The context of a runner of this model and configuration, its params in `dtype`: the model as
    each device holds it and the mesh under tensor parallelism, and the kernels. Checks that the
    devices are there and that the model fits the configuration."""
    tp, replica = config.tensor_parallel_size, config.data_parallel_rank
    mesh = make_mesh(tp, replica) if tp > 1 or replica > 0 else None
    config.check_model(model_config, draft_model)
    model = sharded_config(model_config, tp) if tp > 1 else model_config
    return Context(model, config, Kernels.choose(config.kernels, config.batch_invariant), dtype, draft_model, mesh)


def largest_step_bytes(ctx: Context, warming_up: bool = False) -> int:
    """Temporary device memory of the largest step of `ctx`'s runner, from the compiled executables
    of the largest token bucket's backbone, the fullest sampler at the largest request bucket and,
    where steps run several at a time, the largest decode loop (it holds a backbone's and a
    sampler's temporaries at once): a profiling compile that needs no cache allocated (the cache
    is aliased, so its size changes nothing) and no params (programs are made from their shapes);
    the programs compiled side by side, or the figure a start with the same programs kept in the
    program cache. `warming_up`: the runner sized so compiles every program next: those of
    `KV_FREE_KINDS`, the same whatever the cache's size, compile beside the sizing ones, on cores
    these few compiles leave idle, and its warm-up takes them (`Programs.largest_temp_bytes`)."""
    programs = shared_programs(ctx)
    kv_free = [p for kind in KV_FREE_KINDS for p in programs.examples(kind)] if warming_up else []
    return programs.largest_temp_bytes(_largest_steps(programs), kv_free)


def stored_step_bytes(ctx: Context) -> int | None:
    """`largest_step_bytes` as an earlier start kept it in the program cache, or None: nothing
    compiled or loaded."""
    programs = shared_programs(ctx)
    return programs.stored_temp_bytes(_largest_steps(programs))


def load_programs(ctx: Context) -> tuple[Programs, int]:
    """The programs of a runner of `ctx` (`shared_programs`) with those the program cache holds
    loaded, and how many it loaded: a start reads them while its weights load, and the runner it
    makes next finds them made."""
    programs = shared_programs(ctx)
    return programs, programs.load_stored(programs.warmup_programs())


def _largest_steps(programs: Programs) -> list[Program]:
    """The backbone of the largest token bucket, the fullest sampler of the largest request bucket
    and the largest decode loop: the programs whose temporaries size the KV cache."""
    ctx = programs.ctx
    flags, b = ctx.sampler_variants[-1], ctx.config.request_buckets[-1]
    named = dict(params=ctx.params, last_hidden=ctx.last_hidden(), samples=ctx.samples(b, flags), flags=flags)
    if ctx.spec_tokens:
        sampler = programs.program(SPEC_SAMPLE, draft_params=ctx.draft_params, state=ctx.state, **named)
    else:
        sampler = programs.program(SAMPLE, token_ids=ctx.state.token_ids, **named)
    loops = programs.examples(DECODE_LOOP)[:1]  # the largest first
    return [_forward_program(programs, ctx.config.max_num_batched_tokens), sampler, *loops]


def _forward_program(programs: Programs, num_tokens: int, uniform_decode: bool = False) -> Program:
    ctx = programs.ctx
    tokens = ctx.tokens(bucket(num_tokens, ctx.config.token_buckets))
    return programs.program(FORWARD, params=ctx.params, draft_params=ctx.draft_params, lora=ctx.lora,
                            state=ctx.state, tokens=tokens, uniform_decode=uniform_decode)
