"""Every program the runner compiles, in one table, and the executables made from it.

`jax.jit` compiles on first use, and serving must not compile; so the runner keeps its executables
itself. A program kind is one `Kind` record: its device function (whose keyword-only arguments are
its static options), what it donates, `key`, which tells its executables apart and is computed from
the arguments of the call itself, and `examples`, the arguments of every variant a runner can ask
for. Warm-up compiles exactly the examples and a call finds its executable by the same `key`, so
the two cannot disagree; a call that no example covered compiles on first use, is counted
(`compiled_on_use`) and logged. Adding a program kind is one `Kind` below, added to `KINDS`.

A runner's programs depend only on its `Context` (model, runner configuration, kernels, dtype), so
live runners with equal contexts share one `Programs` (`shared_programs`). `compile_all` lowers programs
one after another (tracing is Python) and compiles them on a thread pool, where XLA works without
the GIL, each compile starting as soon as its program is lowered; with a `ProgramCache` it first
looks for the executable on disk, which needs no lowering.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import inspect
import logging
import os
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrunner.config import Kernels, ModelConfig, RunnerConfig
from jaxrunner.runner.input_batch import RequestTable, build_inputs
from jaxrunner.models.llama import param_specs, param_structs
from jaxrunner.lora.slots import lora_structs, write_slot
from jaxrunner.runner.parallel import place
from jaxrunner.runner.program_cache import ProgramCache, compile_noting_cache_hits
from jaxrunner.sampling import SamplerFlags, flag_variants, neutral_metadata
from jaxrunner.runner.state import init_state, state_specs
from jaxrunner.runner.step import (
    SampleInputs,
    TokenInputs,
    decode_loop,
    forward_step,
    prompt_logprobs_step,
    sample_step,
    spec_sample_step,
    write_block_rows,
    write_token_rows,
)

logger = logging.getLogger(__name__)

# Prompt positions scored per device call: bounds the [rows, vocab] logits of long prompts.
PROMPT_LOGPROBS_CHUNK = 256


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n."""
    return buckets[bisect.bisect_left(buckets, n)]


@dataclass(frozen=True)
class Context:
    """What a runner's programs depend on, and the choices between them that dispatch and the
    examples both make through it. Hashable: runners of equal contexts share their programs."""

    model: ModelConfig
    config: RunnerConfig
    kernels: Kernels
    dtype: str
    draft_model: ModelConfig | None = None  # speculative decoding with a draft model
    mesh: Mesh | None = None  # tensor parallelism: the devices the params and the cache are split over

    @functools.cached_property
    def params(self) -> dict:
        """The params' shapes and dtype (every weight is in the runner's dtype), and shardings."""
        structs = param_structs(self.model, self.dtype)
        return structs if self.mesh is None else place(structs, param_specs(self.model), self.mesh)

    @functools.cached_property
    def draft_params(self) -> dict:
        return param_structs(self.draft_model, self.dtype) if self.draft_model is not None else {}

    @functools.cached_property
    def lora(self) -> tuple:
        """The LoRA slots' shapes (() without LoRA)."""
        return lora_structs(self.model, self.config.lora, self.dtype)

    @functools.cached_property
    def adapter(self) -> tuple:
        """One slot's tensors: what `write_slot` writes."""
        return lora_structs(self.model, dataclasses.replace(self.config.lora, max_loras=1), self.dtype)

    @functools.cached_property
    def state(self):
        state = jax.eval_shape(functools.partial(init_state, self.model, self.config, self.draft_model))
        return state if self.mesh is None else place(state, state_specs(state), self.mesh)

    @property
    def spec_tokens(self) -> int:
        """Drafts per request per step (0: no speculative decoding)."""
        return self.config.speculative.num_speculative_tokens

    @functools.cached_property
    def sampler_variants(self) -> tuple[SamplerFlags, ...]:
        return flag_variants(self.config.sampler, self.model.vocab_size)

    @property
    def decode_form(self) -> bool:
        """Whether the backbone has a decode form: only the Pallas kernels have a decode kernel."""
        return self.kernels.pallas

    def uniform_decode(self, num_scheduled: dict[str, int]) -> bool:
        """Whether a batch runs the backbone's decode form: there is one, and every sequence has at most
        1 + k query tokens (one, without speculative decoding)."""
        return self.decode_form and all(n <= 1 + self.spec_tokens for n in num_scheduled.values())

    def forward_forms(self, t_bucket: int) -> list[bool]:
        """The backbone forms of a token bucket: general, and decode where a decode batch can land
        (it has at most max_num_seqs * (1 + k) tokens)."""
        largest = min(self.config.max_num_seqs * (1 + self.spec_tokens), self.config.max_num_batched_tokens)
        return [False] + [True] * (self.decode_form and t_bucket <= bucket(largest, self.config.token_buckets))

    def loops(self, flags: SamplerFlags) -> bool:
        """Whether a multi-step decode with these flags runs as one device call: plain sampling
        (temperature, seeds, logprobs). Other batches run its rounds through the single-step programs."""
        return flags in self.sampler_variants[:2]

    def tokens(self, t_bucket: int) -> TokenInputs:
        """Padding inputs of a token bucket: the shapes of every real batch in that bucket."""
        empty = RequestTable.empty(self.config.max_num_seqs)
        return build_inputs(empty, [], {}, self.config, self.model.vocab_size, t_bucket, 1)[0]

    def samples(self, b_bucket: int, flags: SamplerFlags) -> SampleInputs:
        nowhere = np.full(b_bucket, self.config.max_num_seqs, np.int32)
        md = neutral_metadata(b_bucket, self.config.sampler, self.model.vocab_size, flags, 1 + self.spec_tokens)
        return SampleInputs(nowhere, np.zeros(b_bucket, np.int32), md, np.zeros(b_bucket, bool), np.zeros(b_bucket, np.int32))

    def hidden(self, rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, self.model.hidden_size), self.dtype)

    def last_hidden(self) -> jax.ShapeDtypeStruct:
        """The backbone's per-sequence hidden states: each sequence's last 1 + k tokens'."""
        return jax.ShapeDtypeStruct((self.config.max_num_seqs, 1 + self.spec_tokens, self.model.hidden_size), self.dtype)


Example = tuple[tuple, dict]  # (arguments, the call's static options)


@dataclass(frozen=True, eq=False)
class Kind:
    """One kind of program. `fixed(ctx)`: the static options all of one runner's calls share; a call
    passes the others, and `key(args, statics)` of those tells its executables apart. `examples(ctx)`
    yields every variant the runner can ask for."""

    name: str
    fn: Callable
    key: Callable[[tuple, dict], tuple]
    examples: Callable[[Context], Iterator[Example]]
    fixed: Callable[[Context], dict] = lambda ctx: {}
    donate_argnums: tuple[int, ...] = ()
    jitted: Callable = field(init=False)

    def __post_init__(self) -> None:
        params = inspect.signature(self.fn).parameters.values()
        statics = tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        object.__setattr__(self, "jitted", jax.jit(self.fn, static_argnames=statics, donate_argnums=self.donate_argnums))


def _write_blocks_examples(ctx: Context) -> Iterator[Example]:
    cfg = ctx.config
    for b in reversed(cfg.request_buckets):
        rows = np.zeros((len(ctx.model.kv_cache_groups), b, cfg.max_blocks_per_req), np.int32)
        yield (ctx.state, np.full(b, cfg.max_num_seqs, np.int32), rows), {}


def _write_tokens_examples(ctx: Context) -> Iterator[Example]:
    cfg = ctx.config
    for b in reversed(cfg.request_buckets):
        yield (ctx.state, np.full(b, cfg.max_num_seqs, np.int32), np.zeros((b, cfg.max_model_len), np.int32)), {}


def _forward_examples(ctx: Context) -> Iterator[Example]:
    for t in reversed(ctx.config.token_buckets):
        for decode in ctx.forward_forms(t):
            yield (ctx.params, ctx.draft_params, ctx.lora, ctx.state, ctx.tokens(t)), dict(uniform_decode=decode)


def _sample_examples(ctx: Context) -> Iterator[Example]:
    if ctx.spec_tokens:
        return
    for b in reversed(ctx.config.request_buckets):
        for flags in ctx.sampler_variants:
            yield (ctx.params, ctx.state, ctx.last_hidden(), ctx.samples(b, flags)), dict(flags=flags)


def _spec_sample_examples(ctx: Context) -> Iterator[Example]:
    if not ctx.spec_tokens:
        return
    for b in reversed(ctx.config.request_buckets):
        for flags in ctx.sampler_variants:
            yield (ctx.params, ctx.draft_params, ctx.state, ctx.last_hidden(), ctx.samples(b, flags)), dict(flags=flags)


def _decode_loop_examples(ctx: Context) -> Iterator[Example]:
    cfg = ctx.config
    if cfg.num_scheduler_steps == 1:
        return
    largest = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    buckets = {(bucket(n, cfg.token_buckets), bucket(n, cfg.request_buckets)) for n in range(1, largest + 1)}
    for t, b in sorted(buckets, reverse=True):  # the (token, request) buckets of a batch of n decodes
        for flags in filter(ctx.loops, ctx.sampler_variants):
            args = (ctx.params, ctx.lora, ctx.state, ctx.tokens(t), ctx.samples(b, flags), np.zeros(b, np.int32))
            yield args, dict(flags=flags, num_steps=cfg.num_scheduler_steps, uniform_decode=ctx.decode_form)


def _prompt_logprobs_examples(ctx: Context) -> Iterator[Example]:
    rows = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
    for t in reversed(ctx.config.token_buckets):
        yield (ctx.params, ctx.hidden(t), rows, rows), {}


def _write_lora_examples(ctx: Context) -> Iterator[Example]:
    if ctx.config.lora.enabled:
        yield (ctx.lora, np.int32(0), ctx.adapter), {}


def _model_and_kernels(ctx: Context) -> dict:
    return dict(model=ctx.model, kernels=ctx.kernels)


def _decode_loop_options(ctx: Context) -> dict:
    return _model_and_kernels(ctx) | dict(max_loras=ctx.config.lora.max_loras, kv_scales=ctx.config.kv_scales)


def _forward_options(ctx: Context) -> dict:
    return dict(model=ctx.model, draft_model=ctx.draft_model, kernels=ctx.kernels, spec_tokens=ctx.spec_tokens,
                max_loras=ctx.config.lora.max_loras, kv_scales=ctx.config.kv_scales)


def _spec_options(ctx: Context) -> dict:
    return dict(model=ctx.model, draft_model=ctx.draft_model, kernels=ctx.kernels, spec=ctx.config.speculative,
                kv_scales=ctx.config.kv_scales)


WRITE_BLOCKS = Kind("write_blocks", write_block_rows, key=lambda args, s: (args[1].shape[0],),
                    examples=_write_blocks_examples, donate_argnums=(0,))
WRITE_TOKENS = Kind("write_tokens", write_token_rows, key=lambda args, s: (args[1].shape[0],),
                    examples=_write_tokens_examples, donate_argnums=(0,))
FORWARD = Kind("forward", forward_step, key=lambda args, s: (args[4].token_ids.shape[0], s["uniform_decode"]),
               examples=_forward_examples, fixed=_forward_options, donate_argnums=(3,))
SAMPLE = Kind("sample", sample_step, key=lambda args, s: (args[3].commit_rows.shape[0], s["flags"]),
              examples=_sample_examples, fixed=_model_and_kernels, donate_argnums=(1,))
SPEC_SAMPLE = Kind("spec_sample", spec_sample_step, key=lambda args, s: (args[4].commit_rows.shape[0], s["flags"]),
                   examples=_spec_sample_examples, fixed=_spec_options, donate_argnums=(2,))
DECODE_LOOP = Kind(
    "decode_loop", decode_loop,
    key=lambda args, s: (args[3].token_ids.shape[0], args[4].commit_rows.shape[0], s["flags"], s["num_steps"], s["uniform_decode"]),
    examples=_decode_loop_examples, fixed=_decode_loop_options, donate_argnums=(2,))
PROMPT_LOGPROBS = Kind(
    "prompt_logprobs", prompt_logprobs_step, key=lambda args, s: (args[1].shape[0],), examples=_prompt_logprobs_examples,
    fixed=lambda ctx: dict(model=ctx.model, num_top=ctx.config.sampler.logprobs_width(ctx.model.vocab_size),
                           as_logits=ctx.config.sampler.logprobs_mode.endswith("logits")))
WRITE_LORA = Kind("write_lora", write_slot, key=lambda args, s: (), examples=_write_lora_examples, donate_argnums=(0,))
# Whole-model programs first: they compile slowest, so they reach the compile pool first.
KINDS = (FORWARD, DECODE_LOOP, SAMPLE, SPEC_SAMPLE, WRITE_BLOCKS, WRITE_TOKENS, PROMPT_LOGPROBS, WRITE_LORA)


@dataclass(frozen=True)
class Program:
    """One call of a kind, with every static option resolved: what `Programs` compiles and runs."""

    kind: Kind
    key: Hashable
    args: tuple
    statics: dict


class Programs:
    """The executables of one context, by program key."""

    def __init__(self, ctx: Context, cache: ProgramCache | None = None) -> None:
        self.ctx = ctx
        self._compiled: dict[Hashable, jax.stages.Compiled] = {}
        self._cache = cache
        self.asked: set[Hashable] = set()  # every key a call asked for
        self.warm: set[Hashable] = set()  # the keys of `warmup_programs`, once `warm_up` compiled them
        self.compiled_on_use = 0
        self.loaded = 0  # by compile_all from the program cache
        self.lowering_seconds = 0.0  # spent by compile_all under the GIL: what no compile thread overlaps

    def program(self, kind: Kind, *args, **statics) -> Program:
        return Program(kind, (kind.name, *kind.key(args, statics)), args, kind.fixed(self.ctx) | statics)

    def examples(self, kind: Kind) -> list[Program]:
        return [self.program(kind, *args, **statics) for args, statics in kind.examples(self.ctx)]

    def warmup_programs(self) -> list[Program]:
        """Every program a runner of this context can ask for."""
        return [p for kind in KINDS for p in self.examples(kind)]

    def warm_up(self) -> tuple[int, int]:
        """Compile every program of `warmup_programs`; (how many there are, how many were new)."""
        programs = self.warmup_programs()
        compiled = self.compile_all(programs)
        self.warm.update(p.key for p in programs)
        return len(programs), compiled

    def run(self, kind: Kind, *args, **statics):
        program = self.program(kind, *args, **statics)
        self.asked.add(program.key)
        exe = self._compiled.get(program.key)
        if exe is None:
            if self.warm:
                logger.warning("compiling %s while serving: no warm-up example covers it", program.key)
            exe = self._compiled[program.key] = self._lower(program).compile()
            self.compiled_on_use += 1
        return exe(*args)

    def executable(self, program: Program) -> jax.stages.Compiled:
        """The executable, compiled now if needed (not counted: for inspection, e.g. memory_analysis)."""
        if program.key not in self._compiled:
            self.compile_all([program])
        return self._compiled[program.key]

    def compile_all(self, programs: Sequence[Program], workers: int | None = None) -> int:
        """Make the programs not compiled yet ready, in parallel; how many that was. Those in the
        program cache are loaded; each other is lowered and handed to the pool at once, so lowering
        the next (Python, under the GIL) overlaps compiling the previous ones: list the slowest
        compiles first."""
        todo = {p.key: p for p in programs if p.key not in self._compiled}
        devices = tuple(d.id for d in self.ctx.mesh.devices.flat) if self.ctx.mesh is not None else ()  # a replica's own
        cache_keys = ({key: self._cache.key(p.kind.jitted, (key, devices), p.args, p.statics) for key, p in todo.items()}
                      if self._cache else {})
        workers = workers or min(len(todo), os.cpu_count() or 1) or 1
        with ThreadPoolExecutor(workers) as pool:
            if cache_keys:
                for key, exe in zip(cache_keys, pool.map(self._cache.load, cache_keys.values())):
                    if exe is not None:
                        self._compiled[key] = exe
                        self.loaded += 1
            futures = {}
            for key, p in todo.items():
                if key not in self._compiled:
                    start = time.perf_counter()
                    lowered = self._lower(p)
                    self.lowering_seconds += time.perf_counter() - start
                    futures[key] = pool.submit(self._compile, lowered, cache_keys.get(key))
            for key, future in futures.items():
                self._compiled[key] = future.result()
        return len(todo)

    def _lower(self, program: Program) -> jax.stages.Lowered:
        """Under tensor parallelism, on the context's mesh: host arrays are then replicated over it."""
        if self.ctx.mesh is None:
            return program.kind.jitted.lower(*program.args, **program.statics)
        with jax.set_mesh(self.ctx.mesh):
            return program.kind.jitted.lower(*program.args, **program.statics)

    def _compile(self, lowered: jax.stages.Lowered, cache_key: str | None) -> jax.stages.Compiled:
        exe, fresh = compile_noting_cache_hits(lowered)
        if cache_key and fresh:
            self._cache.store(cache_key, exe)
        return exe


# Live `Programs` by context, held weakly: executables go with the last runner that uses them (each
# holds memory maps of its own, and Linux allows a process 65530 of them).
_shared: weakref.WeakValueDictionary[Context, Programs] = weakref.WeakValueDictionary()


def shared_programs(ctx: Context) -> Programs:
    """The `Programs` of a context, shared by its live runners; in the program cache of its
    `compilation_cache_dir` if it has one."""
    programs = _shared.get(ctx)
    if programs is None:
        cache_dir = ctx.config.compilation_cache_dir
        programs = _shared[ctx] = Programs(ctx, ProgramCache(os.path.join(cache_dir, "programs")) if cache_dir else None)
    return programs
