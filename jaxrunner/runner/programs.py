"""Every program the runner compiles, in one table, and the executables made from it.

`jax.jit` compiles on first use, and serving must not compile; so the runner keeps its executables
itself. A program kind is one `Kind` record: its device function (whose keyword-only arguments are
its static options), what it donates, `key`, which tells its executables apart and is computed from
the arguments of the call itself, and `examples`, the calls made by the plans of synthetic schedules
(`plan.warmup_plans`, which `plan.prepare` makes as it makes a served step's). Warm-up compiles
exactly the examples and a call finds its executable by the same `key`, so the two cannot
disagree; a call that no example covered compiles on first use (or loads from the program cache),
is counted (`compiled_on_use`) and logged. Adding a program kind is one `Kind` below, added to `KINDS`.

A runner's programs depend only on its `Context` (model, runner configuration, kernels, dtype), so
live runners with equal contexts share one `Programs` (`shared_programs`). `compile_all` lowers programs
one after another (tracing is Python) and compiles them on a thread pool, where XLA works without
the GIL, each compile starting as soon as its program is lowered; with a `ProgramCache` it first
looks for the executable on disk, which needs no lowering.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxrunner.config import RunnerConfig
from jaxrunner.lora.slots import write_slot
from jaxrunner.runner.context import PIECE_GROUPS, Context
from jaxrunner.runner.plan import StepPlan, warmup_plans
from jaxrunner.runner.program_cache import ProgramCache, compile_noting_cache_hits
from jaxrunner.runner.step import (
    decode_loop,
    forward_step,
    gather_blocks,
    prompt_logprobs_step,
    sample_step,
    scatter_blocks,
    stack_pieces,
    write_block_rows,
    write_token_rows,
)
from jaxrunner.sampling import PROMPT_LOGPROBS_CHUNK
from jaxrunner.spec_decode.sample import spec_sample_step

logger = logging.getLogger(__name__)
Progress = Callable[[int, int], None]  # (programs ready, programs in all), as warm-up goes

Example = dict  # a call's named arguments, its static options among them
Plans = list[StepPlan]  # the plans of warm-up's synthetic schedules (`plan.warmup_plans`)
Gemm = tuple[str, int]  # a model matmul by its weights and rows (`Kind.gemms`)


@dataclass(frozen=True, eq=False)
class Kind:
    """One kind of program, its arguments read by name. `fixed(ctx)`: the static options all of one
    runner's calls share; a call names the other arguments, and `key` of them tells its executables
    apart. `examples(ctx, plans)` yields the calls the plans of warm-up's synthetic schedules make
    (those of every variant a runner can ask for); `donate` names the arguments whose buffers the
    program takes over. `gemms(key)` names the model's matmuls a program of that key makes, by their
    weights and rows, where other programs may make the same fusions: XLA autotunes each distinct
    fusion once per process, so warm-up compiles a program whose matmuls another one tunes after
    that one (`tuning_order`). The names are a guess at shared fusions (XLA keys a tuning by the
    fusion's text, consumers included); a wrong one only delays a compile."""

    name: str
    fn: Callable
    key: Callable[[dict], tuple]
    examples: Callable[[Context, Plans], Iterator[Example]]
    fixed: Callable[[Context], dict] = lambda ctx: {}
    donate: tuple[str, ...] = ()
    gemms: Callable[[tuple], tuple[Gemm, ...]] = lambda key: ()
    jitted: Callable = field(init=False)
    arguments: tuple[str, ...] = field(init=False)  # the traced ones, in the function's order

    def __post_init__(self) -> None:
        params = inspect.signature(self.fn).parameters.values()
        statics = tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        object.__setattr__(self, "arguments", tuple(p.name for p in params if p.name not in statics))
        object.__setattr__(self, "jitted", jax.jit(self.fn, static_argnames=statics, donate_argnames=self.donate))


def _write_blocks_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for plan in plans:
        if plan.block_rows is not None:
            yield dict(state=ctx.state, slots=plan.block_rows.slots, rows=plan.block_rows.rows)


def _write_tokens_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for plan in plans:
        if plan.token_rows is not None:
            yield dict(state=ctx.state, slots=plan.token_rows.slots, rows=plan.token_rows.rows)


def _forward_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for plan in plans:
        yield dict(params=ctx.params, draft_params=ctx.draft_params, lora=ctx.lora, state=ctx.state, tokens=plan.tokens,
                   uniform_decode=plan.uniform_decode)


def _sampler_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for plan in plans:
        yield dict(params=ctx.params, last_hidden=ctx.last_hidden(), samples=plan.samples, flags=plan.flags)


def _sample_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    if not ctx.spec_tokens:
        for named in _sampler_examples(ctx, plans):
            yield named | dict(token_ids=ctx.state.token_ids)


def _spec_sample_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    if ctx.spec_tokens:
        for named in _sampler_examples(ctx, plans):
            yield named | dict(draft_params=ctx.draft_params, state=ctx.state)


def _decode_loop_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for plan in plans:
        if plan.sched.num_steps > 1 and ctx.loops(plan.flags):
            yield dict(params=ctx.params, lora=ctx.lora, state=ctx.state, tokens=plan.tokens, samples=plan.samples,
                       steps=plan.rounds, flags=plan.flags, num_steps=plan.sched.num_steps,
                       uniform_decode=plan.uniform_decode)


def _prompt_logprobs_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    rows = np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32)
    for plan in plans:
        yield dict(params=ctx.params, hidden=ctx.hidden(plan.tokens.token_ids.shape[0]), rows=rows, targets=rows)


def _write_lora_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    if ctx.config.lora.enabled:
        yield dict(lora=ctx.lora, slot=np.int32(0), adapter=ctx.adapter)


def piece_groups(ctx: Context) -> Iterator[tuple[int, int]]:
    """(blocks per piece, pieces) of each group the host tier gathers or writes in one program."""
    for n in ctx.kv_transfer_buckets:
        for count in PIECE_GROUPS if n == ctx.kv_transfer_buckets[-1] else (1,):
            yield n, count


def _gather_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for n, count in piece_groups(ctx):
        yield dict(pages=(ctx.state.kv, ctx.state.draft_kv), blocks=np.zeros(n * count, np.int32), pieces=count)


def _stack_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for n, count in piece_groups(ctx):
        yield dict(packed=(ctx.packed_blocks(n),) * count, rows=ctx.kv_transfer_buckets[-1])


def _scatter_examples(ctx: Context, plans: Plans) -> Iterator[Example]:
    for n, count in piece_groups(ctx):
        if n == ctx.kv_transfer_buckets[-1]:  # the others are padded to it first (`stack_pieces`)
            yield dict(state=ctx.state, blocks=np.zeros(n * count, np.int32), rows=ctx.packed_blocks(n * count))


def _model_and_kernels(ctx: Context) -> dict:
    return dict(model=ctx.model, kernels=ctx.kernels)


def _decode_loop_options(ctx: Context) -> dict:
    return _model_and_kernels(ctx) | dict(max_loras=ctx.config.lora.max_loras, kv_scales=ctx.config.kv_scales)


def _forward_options(ctx: Context) -> dict:
    return dict(model=ctx.model, draft_model=ctx.draft_model, kernels=ctx.kernels, queries_per_seq=ctx.queries_per_decode,
                max_loras=ctx.config.lora.max_loras, kv_scales=ctx.config.kv_scales)


def _spec_options(ctx: Context) -> dict:
    return dict(model=ctx.model, draft_model=ctx.draft_model, kernels=ctx.kernels, spec=ctx.config.speculative,
                kv_scales=ctx.config.kv_scales)


def _rows(a: dict) -> tuple:
    return (a["slots"].shape[0],)


WRITE_BLOCKS = Kind("write_blocks", write_block_rows, key=_rows, examples=_write_blocks_examples, donate=("state",))
WRITE_TOKENS = Kind("write_tokens", write_token_rows, key=_rows, examples=_write_tokens_examples, donate=("state",))
FORWARD = Kind("forward", forward_step, key=lambda a: (a["tokens"].token_ids.shape[0], a["uniform_decode"]),
               examples=_forward_examples, fixed=_forward_options, donate=("state",),
               gemms=lambda key: (("layers", key[0]),))
SAMPLE = Kind("sample", sample_step, key=lambda a: (a["samples"].commit_rows.shape[0], a["flags"]),
              examples=_sample_examples, fixed=_model_and_kernels, donate=("token_ids",),
              gemms=lambda key: (("lm_head", key[0]),))
SPEC_SAMPLE = Kind("spec_sample", spec_sample_step, key=lambda a: (a["samples"].commit_rows.shape[0], a["flags"]),
                   examples=_spec_sample_examples, fixed=_spec_options, donate=("state",))
DECODE_LOOP = Kind(
    "decode_loop", decode_loop,
    key=lambda a: (a["tokens"].token_ids.shape[0], a["samples"].commit_rows.shape[0], a["flags"], a["num_steps"],
                   a["uniform_decode"]),
    examples=_decode_loop_examples, fixed=_decode_loop_options, donate=("state",),
    gemms=lambda key: (("layers", key[0]), ("lm_head", key[1])))
PROMPT_LOGPROBS = Kind(
    "prompt_logprobs", prompt_logprobs_step, key=lambda a: (a["hidden"].shape[0],), examples=_prompt_logprobs_examples,
    gemms=lambda key: (("lm_head", PROMPT_LOGPROBS_CHUNK),),
    fixed=lambda ctx: dict(model=ctx.model, kernels=ctx.kernels,
                           num_top=ctx.config.sampler.logprobs_width(ctx.model.vocab_size),
                           as_logits=ctx.config.sampler.logprobs_mode.endswith("logits")))
WRITE_LORA = Kind("write_lora", write_slot, key=lambda a: (), examples=_write_lora_examples, donate=("lora",))
GATHER_BLOCKS = Kind("gather_blocks", gather_blocks, key=lambda a: (a["blocks"].shape[0], a["pieces"]),
                     examples=_gather_examples, fixed=lambda ctx: dict(shards=ctx.model.shards))
STACK_PIECES = Kind("stack_pieces", stack_pieces, key=lambda a: (a["packed"][0].shape[0], len(a["packed"]), a["rows"]),
                    examples=_stack_examples)
SCATTER_BLOCKS = Kind("scatter_blocks", scatter_blocks, key=lambda a: (a["blocks"].shape[0],),
                      examples=_scatter_examples, fixed=lambda ctx: dict(shards=ctx.model.shards), donate=("state",))
# Whole-model programs first: they compile slowest, so they reach the compile pool first.
KINDS = (FORWARD, DECODE_LOOP, SAMPLE, SPEC_SAMPLE, WRITE_BLOCKS, WRITE_TOKENS, PROMPT_LOGPROBS, WRITE_LORA,
         GATHER_BLOCKS, STACK_PIECES, SCATTER_BLOCKS)
# Kinds that take no KV pages: their programs are the same whatever the cache's size.
KV_FREE_KINDS = (SAMPLE, PROMPT_LOGPROBS, WRITE_LORA)
# What KV sizing compiled for the warm-up after it (`largest_temp_bytes`' `alongside`), by program-cache
# key, until that warm-up takes it: an executable JAX's own persistent cache gave back is not stored
# in the program cache (`program_cache.compile_noting_cache_hits`), so the warm-up would lower it again.
_sized_alongside: dict[str, jax.stages.Compiled] = {}


def tuning_order(programs: Sequence[Program]) -> dict[Hashable, set[Hashable]]:
    """The programs to compile after others, each with those others: a program all of whose matmuls
    (`Kind.gemms`) an earlier-listed program makes waits for the first program making each of them.
    One with a matmul of its own, or none named, waits for nothing (it is not in the result)."""
    first: dict[Gemm, Hashable] = {}
    behind: dict[Hashable, set[Hashable]] = {}
    for program in programs:
        gemms = program.kind.gemms(program.key[1:])
        if gemms and all(g in first for g in gemms):
            behind[program.key] = {first[g] for g in gemms}
        for g in gemms:
            first.setdefault(g, program.key)
    return behind


@dataclass(frozen=True)
class Program:
    """One call of a kind, with every static option resolved: what `Programs` compiles and runs.
    `args`: the traced arguments in the function's order."""

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
        self.loaded = 0  # from the program cache (`load_stored`, warm-up's or read ahead), or handed over by KV sizing
        # spent lowering by program kind (under the GIL: what no compile thread overlaps); of it, tracing
        # the Python into a jaxpr (the rest lowers the jaxpr, its kernels included)
        self.lowering_by_kind: Counter[str] = Counter()
        self.tracing_seconds = 0.0
        # a compile thread's seconds per program compiled here (XLA, and storing it in the program cache):
        # whether the compiles' sum or one long compile bounds the warm-up
        self.compile_seconds: dict[Hashable, float] = {}
        self.compile_ended: dict[Hashable, float] = {}  # and when it ended (`time.perf_counter`)

    @property
    def lowering_seconds(self) -> float:
        return sum(self.lowering_by_kind.values())

    def program(self, kind: Kind, **named) -> Program:
        """The call of `kind` with these named arguments (traced ones and static options)."""
        if missing := set(kind.arguments) - named.keys():
            raise TypeError(f"program {kind.name} needs {sorted(missing)}")
        statics = {name: value for name, value in named.items() if name not in kind.arguments}
        return Program(kind, (kind.name, *kind.key(named)), tuple(named[name] for name in kind.arguments),
                       kind.fixed(self.ctx) | statics)

    def examples(self, kind: Kind, plans: Plans | None = None) -> list[Program]:
        """The distinct programs of `kind` that warm-up's plans (or `plans`) call, in the plans'
        order (the largest first)."""
        unique = {}
        for named in kind.examples(self.ctx, self._warmup_plans if plans is None else plans):
            program = self.program(kind, **named)
            unique.setdefault(program.key, program)
        return list(unique.values())

    @functools.cached_property
    def _warmup_plans(self) -> Plans:
        return warmup_plans(self.ctx)

    def warmup_programs(self, serving: Context | None = None) -> list[Program]:
        """Every program a runner of this context can ask for; or, serving with `serving`'s buckets
        (`plan.bucket_tiers`), the programs those ask for."""
        plans = None if serving is None or serving == self.ctx else warmup_plans(serving)
        return [p for kind in KINDS for p in self.examples(kind, plans)]

    def warm_up(self, programs: Sequence[Program] | None = None, progress: Progress = lambda done, total: None,
                total: int | None = None, stop: threading.Event | None = None) -> tuple[int, int]:
        """Compile `programs` (every program of `warmup_programs` if None); (how many there are, how
        many were new). `progress(done, total)` hears of each one ready, out of `total` if given
        (a background warm-up's, over its tiers). Once `stop` is set, no further program starts."""
        programs = self.warmup_programs() if programs is None else programs
        report = progress if total is None else lambda done, _: progress(done, total)
        compiled = self.compile_all(programs, progress=report, stop=stop)
        self.warm.update(p.key for p in programs if p.key in self._compiled)
        return len(programs), compiled

    def run(self, kind: Kind, **named):
        program = self.program(kind, **named)
        self.asked.add(program.key)
        exe = self._compiled.get(program.key)
        if exe is None:
            if self.warm:
                logger.warning("compiling (or loading) %s while serving: no warm-up example covers it", program.key)
            self.compile_all([program])  # or loaded from the program cache, as warm-up's are
            exe = self._compiled[program.key]
            self.compiled_on_use += 1
        return exe(*program.args)

    def compile_for_step(self, programs: Sequence[Program]) -> None:
        """Without a warm-up, a step's programs not made yet, made together before the step runs
        them: `compile_all` compiles them in parallel where `run`, making each as the step first
        calls it, would take the sum of their compiles. Counted as compiled on use."""
        missing = [p for p in programs if p.key not in self._compiled]
        if missing:
            self.compiled_on_use += self.compile_all(missing)

    def executable(self, program: Program) -> jax.stages.Compiled:
        """The executable, compiled now if needed (not counted: for inspection, e.g. memory_analysis)."""
        if program.key not in self._compiled:
            self.compile_all([program])
        return self._compiled[program.key]

    def compile_all(self, programs: Sequence[Program], workers: int | None = None,
                    progress: Progress = lambda done, total: None, stop: threading.Event | None = None) -> int:
        """Make the programs not compiled yet ready, in parallel; how many that was. Those in the
        program cache are loaded; each other is lowered and handed to the pool, so lowering the
        next (Python, under the GIL) overlaps compiling the previous ones: list the slowest compiles
        first. A program goes to the pool at once unless `tuning_order` puts it behind others: it
        then waits for their compiles, whose autotuning XLA keeps for it, where compiling beside
        them would tune the same matmuls again. `progress(done, total)` is called as programs
        become ready. Once `stop` is set no further program is lowered; those lowered finish."""
        todo = {p.key: p for p in programs if p.key not in self._compiled}
        total = len(programs)
        workers = workers or min(len(todo), os.cpu_count() or 1) or 1
        cache_keys = {key: self._cache_key(p) for key, p in todo.items()} if self._cache else {}
        self._load_stored(cache_keys, workers)
        with ThreadPoolExecutor(workers) as pool:
            ready = total - len(todo) + sum(key in self._compiled for key in todo)
            progress(ready, total)
            behind = tuning_order([p for key, p in todo.items() if key not in self._compiled])
            submitted: dict[Hashable, Future] = {}
            compiling: dict[Future, Hashable] = {}
            waiting: dict[Hashable, jax.stages.Lowered] = {}  # lowered, behind compiles not done yet

            def submit(key: Hashable, lowered: jax.stages.Lowered) -> None:
                submitted[key] = pool.submit(self._compile, key, lowered, cache_keys.get(key))
                compiling[submitted[key]] = key

            def release() -> None:
                for key in [key for key in waiting if all(submitted[k].done() for k in behind[key])]:
                    submit(key, waiting.pop(key))

            for key, p in todo.items():
                if stop is not None and stop.is_set():
                    break
                if key not in self._compiled:
                    lowered = self._lower(p)
                    if key in behind:  # those it waits for come earlier in the list: they are submitted
                        waiting[key] = lowered
                    else:
                        submit(key, lowered)
                    release()
            while compiling:
                done, _ = wait(compiling, return_when=FIRST_COMPLETED)
                for future in done:
                    self._compiled[compiling.pop(future)] = future.result()
                    ready += 1
                    progress(ready, total)
                release()
        return sum(key in self._compiled for key in todo)

    def load_stored(self, programs: Sequence[Program], workers: int | None = None) -> int:
        """Those of `programs` not made yet that the program cache holds (or KV sizing handed over),
        loaded in parallel; how many. Compiles none, so it may run beside the weights' loading."""
        return self._load_stored({p.key: self._cache_key(p) for p in programs if p.key not in self._compiled}
                                 if self._cache else {}, workers)

    def _load_stored(self, cache_keys: dict[Hashable, str], workers: int | None) -> int:
        if not cache_keys:
            return 0
        with ThreadPoolExecutor(workers or min(len(cache_keys), os.cpu_count() or 1)) as pool:
            made = {key: exe for key, exe in zip(cache_keys, pool.map(self._load, cache_keys.values())) if exe is not None}
        self._compiled.update(made)
        self.loaded += len(made)
        return len(made)

    def stored_temp_bytes(self, programs: Sequence[Program]) -> int | None:
        """`largest_temp_bytes` as an earlier start with the program cache measured it, or None."""
        return self._cache.load_figure(self._figure_key(programs)) if self._cache else None

    def largest_temp_bytes(self, programs: Sequence[Program], alongside: Sequence[Program] = ()) -> int:
        """The largest temporary device memory of `programs` (their executables' `memory_analysis`).
        With a program cache, the figure is kept beside the executables, so a start that finds it
        loads none of them for it. Where it compiles them, `alongside` compile in the same pool:
        programs that the runner this figure sizes (a context that differs in the cache's size
        alone) makes under the same program-cache keys, and its `compile_all` takes them from
        `_sized_alongside`. Without a program cache there are no keys to match them by, and they are
        left to that runner."""
        if (figure := self.stored_temp_bytes(programs)) is not None:
            return figure
        alongside = alongside if self._cache else ()
        self.compile_all([*programs, *alongside])
        _sized_alongside.clear()  # a start that failed before its warm-up left its own: they go
        _sized_alongside.update({self._cache_key(p): self._compiled[p.key] for p in alongside if p.key in self._compiled})
        figure = max(self._compiled[p.key].memory_analysis().temp_size_in_bytes for p in programs)
        if self._cache:
            self._cache.store_figure(self._figure_key(programs), figure)
        return figure

    def _figure_key(self, programs: Sequence[Program]) -> str:
        return hashlib.sha256(" ".join(map(self._cache_key, programs)).encode()).hexdigest()

    def _load(self, cache_key: str) -> jax.stages.Compiled | None:
        exe = _sized_alongside.pop(cache_key, None)
        return exe if exe is not None else self._cache.load(cache_key)

    def _cache_key(self, program: Program) -> str:
        devices = tuple(d.id for d in self.ctx.mesh.devices.flat) if self.ctx.mesh is not None else ()  # a replica's own
        return self._cache.key(program.kind.jitted, (program.key, devices), program.args, program.statics)

    def _lower(self, program: Program) -> jax.stages.Lowered:
        """Under tensor parallelism, on the context's mesh: host arrays are then replicated over it."""
        with jax.set_mesh(self.ctx.mesh) if self.ctx.mesh is not None else contextlib.nullcontext():
            start = time.perf_counter()
            traced = program.kind.jitted.trace(*program.args, **program.statics)
            traced_at = time.perf_counter()
            lowered = traced.lower()
        self.tracing_seconds += traced_at - start
        self.lowering_by_kind[program.kind.name] += time.perf_counter() - start
        return lowered

    def _compile(self, key: Hashable, lowered: jax.stages.Lowered, cache_key: str | None) -> jax.stages.Compiled:
        start = time.perf_counter()
        exe, fresh = compile_noting_cache_hits(lowered)
        if cache_key and fresh:
            self._cache.store(cache_key, exe)
        self.compile_ended[key] = time.perf_counter()
        self.compile_seconds[key] = self.compile_ended[key] - start
        return exe


def compile_report(seconds: dict[Hashable, float], ended: dict[Hashable, float]) -> dict:
    """A warm-up's compile threads' seconds by program kind, and its three longest compiles (kind and
    first key, the bucket): their sum over the pool's threads against the longest says whether more
    threads or a shorter program would shorten the warm-up. And when each kind's last compile ended
    (`ended`: seconds from the warm-up's start): which kind's compiles end the warm-up."""
    by_kind: Counter[str] = Counter()
    done: dict[str, float] = {}
    for key, spent in seconds.items():
        by_kind[key[0]] += spent
        done[key[0]] = max(done.get(key[0], 0.0), ended[key])
    slowest = sorted(seconds.items(), key=lambda item: item[1], reverse=True)[:3]
    return {"compile_thread_seconds_by_kind": {kind: round(spent, 2) for kind, spent in by_kind.items()},
            "compiles_done_by_kind": {kind: round(at, 2) for kind, at in done.items()},
            "slowest_compiles": [[" ".join(map(str, key[:2])), round(spent, 2)] for key, spent in slowest]}


# Live `Programs` by context, held weakly: executables go with the last runner that uses them (each
# holds memory maps of its own, and Linux allows a process 65530 of them).
_shared: weakref.WeakValueDictionary[Context, Programs] = weakref.WeakValueDictionary()


def shared_programs(ctx: Context) -> Programs:
    """The `Programs` of a context, shared by its live runners; in the program cache of its
    `compilation_cache_dir` if it has one."""
    programs = _shared.get(ctx)
    if programs is None:
        programs = _shared[ctx] = Programs(ctx, program_cache_of(ctx.config))
    return programs


def program_cache_of(config: RunnerConfig) -> ProgramCache | None:
    """The program cache in `config`'s `compilation_cache_dir`, None without one."""
    cache_dir = config.compilation_cache_dir
    return ProgramCache(os.path.join(cache_dir, "programs")) if cache_dir else None
