"""LLMEngine: tokenizer, scheduler, block manager and runner, one `step()` at a time.

`add_request` queues a prompt; each `step()` schedules one batch, dispatches it to the runner, takes
the sampled tokens of the batch before it (async scheduling; of this one otherwise), detokenizes,
applies stop strings and returns a `RequestOutput` for every request that progressed. A request with n > 1 runs as n child requests ("{i}_{id}") whose prompt blocks are
shared through the prefix cache. A prompt that cannot run (too long, empty, unknown token ids)
fails alone: its output has finish_reason "error" and says why.

Logprobs take vLLM's form: one {token_id: Logprob} dict per generated token (the sampled token and
the top N), and prompt logprobs as a list with None for the first prompt token. The runner gives a
prompt's logprobs once, in the step that completes the prompt, and the parent keeps them: a request
resumed after preemption is not given them again, and children share the prompt, so only the first
child asks for them (the others can then use its prompt blocks from the prefix cache).

A structured-output request waits, off the scheduler, while its grammar compiles on a thread pool
(`GrammarCompiler`), then runs with a copy of it; a grammar that does not compile fails its
request alone (finish_reason "error", `error` says why).

A request without sampling params takes `sampling_defaults`: the model's, from its
generation_config.json (`engine.generation_config`), else SamplingParams' own.

A request ends with finish_reason "abort" when aborted (its blocks freed at once, any token still in
flight for it dropped), or "error" when its logits held NaN. `drain()` waits for every step in
flight; `close()` drains and aborts the rest, and an engine never closed is drained when dropped or
at interpreter exit, since a device step still running then makes the process abort.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import jax

from jaxrunner import platform
from jaxrunner.engine.block_manager import BlockManager
from jaxrunner.engine.host_tier import HostTier
from jaxrunner.engine.default_model import default_tokenizer
from jaxrunner.engine.detokenizer import IncrementalDetokenizer
from jaxrunner.engine.engine_args import (
    EngineArgs,
    compilation_cache_dir,
    conversion_dtype,
    held_model_config,
    host_tier_max_loads,
    load_draft_model,
    load_programs_ahead,
    load_weights,
    open_draft_model,
    open_model,
    resolve_dtype,
    runner_config,
    scheduler_config,
    warm_up,
)
from jaxrunner.engine.generation_config import sampling_defaults
from jaxrunner.engine.model_files import local_model
from jaxrunner.engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from jaxrunner.engine.processor import ProcessedPrompt, Processor, Prompt
from jaxrunner.engine.request import Request, RequestStatus
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.engine.structured_output import GrammarCompiler, new_grammar
from jaxrunner.engine.warmup_progress import WarmupProgress
from jaxrunner.lora_request import LoRARequest
from jaxrunner.runner.pending_output import PendingOutput
from jaxrunner.runner import Runner
from jaxrunner.runner.memory import kv_cache_bytes
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.step_io import LogprobsArrays, RunnerOutput

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class _Child:
    """`logprobs` and `cumulative_logprob` stay None unless the request asked for logprobs."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_sent_tokens: int = 0
    sent_finished: bool = False
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class _Parent:
    """`prompt_logprobs`: vLLM's list, once the runner gave them (with `delta`, until sent)."""

    request_id: str
    inputs: ProcessedPrompt
    delta: bool
    children: list[_Child] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def load_tokenizer(args: EngineArgs):
    if args.skip_tokenizer_init:
        return None
    if args.model is None and args.tokenizer is None:
        return default_tokenizer()
    from transformers import AutoTokenizer

    path = args.tokenizer or args.model
    hint = "pass tokenizer=DIR (--tokenizer), or skip_tokenizer_init=True (--skip-tokenizer-init) and give prompts as token ids"
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path!r} does not exist; {hint}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{path!r} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); {hint}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"could not load a tokenizer from {path!r} ({reason:.200}); {hint}") from None


class LLMEngine:
    def __init__(self, args: EngineArgs, defer_warm_up: bool = False) -> None:
        """`defer_warm_up`: leave the programs' compilation to an explicit `warm_up()` (a server
        opens its port first and answers /health "starting" meanwhile)."""
        platform.claim_gpu_memory()  # before anything starts JAX's backend
        platform.limit_gemm_autotuning()
        # before the weights load: random weights' draws and quantizing compile programs too
        platform.use_compilation_cache(compilation_cache_dir())
        built_in = False
        if args.load_format == "auto":  # the model's files on local disk (None: the tiny random model)
            need_tokenizer = args.tokenizer is None and not args.skip_tokenizer_init
            local = local_model(args.model, need_tokenizer, conversion_dtype(args), args.quantization)
            built_in = args.model is None and local is not None
            args = dataclasses.replace(args, model=local)
        self.args = args
        # The SamplingParams fields a request leaves out take (vLLM's generation_config).
        self.sampling_defaults = sampling_defaults(args.generation_config, args.model, built_in)
        self._closed = False
        checkpoint = open_model(args)  # before the tokenizer: a bad path or file is named as such
        self.tokenizer = load_tokenizer(args)
        dtype = resolve_dtype(args)
        model_config = held_model_config(args, checkpoint)
        # The EOS ids, the tokenizer's first: the one set the scheduler stops on and min_tokens bans.
        tokenizer_eos = () if self.tokenizer is None or self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        eos = tuple(dict.fromkeys((*tokenizer_eos, *model_config.eos_token_ids)))
        self.model_config = dataclasses.replace(model_config, eos_token_ids=eos)
        draft_model = open_draft_model(args, self.model_config, dtype)
        draft_config = draft_model[0] if draft_model else None
        warms_now = warm_up(args) and not defer_warm_up
        start = time.perf_counter()
        with ThreadPoolExecutor(1, thread_name_prefix="jaxrunner-programs-ahead") as ahead:
            # a start like an earlier one finds its runner's programs in the program cache: read meanwhile
            pending = ahead.submit(load_programs_ahead, args, self.model_config, dtype, draft_config) if warms_now else None
            _, params = jax.block_until_ready(load_weights(args, checkpoint, dtype))
            draft = load_draft_model(args, draft_model, dtype)
            weights_loaded = time.perf_counter()
            programs, read_ahead = (pending.result() if pending else None) or (None, 0)
        loaded = time.perf_counter()
        self.config = runner_config(args, self.model_config, dtype, draft_config,
                                    warming_up=warms_now and not args.compile_in_background)
        sized = time.perf_counter()
        self.runner = Runner(self.model_config, params, self.config, draft)
        if programs is not None and programs is not self.runner.programs:
            logger.info("the programs read ahead were for a KV cache of %d blocks, sizing took %d: warm-up makes its own",
                        programs.ctx.config.num_blocks, self.config.num_blocks)
            read_ahead = 0
        del programs  # the runner holds those it uses; others go before its warm-up
        with self._out_of_memory_named("making the KV cache"):
            self.state = self.runner.init_state()
        self.processor = Processor(self.tokenizer, self.runner.check_sampling_params, self.config.max_model_len,
                                   self.model_config.vocab_size)
        self.startup: dict = {}  # the start-up report: seconds per phase, programs, KV cache size
        self._phases = {"load_seconds": round(weights_loaded - start, 2),  # the weights, the draft's too
                        # the programs read from the program cache meanwhile (`load_programs_ahead`), the runner's:
                        # how many (its warm-up finds them made), and how long the start waited for them after loading
                        "loaded_ahead": read_ahead, "ahead_wait_seconds": round(loaded - weights_loaded, 2),
                        "kv_sizing_seconds": round(sized - loaded, 2)}
        self.warm = not warm_up(args)  # every program a step can run compiled (or none to compile ahead)
        host_tier = HostTier(self.config.num_host_blocks, self.runner.host_kv.arrived,
                             host_tier_max_loads(self.model_config, self.config, draft_config),
                             self.runner.host_kv.buckets) if self.runner.host_kv else None
        self.block_manager = BlockManager(self.config.num_blocks, self.config.block_size, args.enable_prefix_caching,
                                          self.model_config.group_windows,
                                          self.config.speculative.num_speculative_tokens, host_tier)
        self.scheduler = Scheduler(scheduler_config(self.config, self.model_config.vocab_size), self.block_manager)
        self._grammars: GrammarCompiler | None = None  # made for the first structured-output request
        self._compiling: list[tuple[_Parent, Future]] = []  # requests whose grammar is on its way
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Child]] = {}
        self._ready: list[RequestOutput] = []  # outputs the next step() returns first
        self._token_texts: dict[int, str] = {}
        self._in_flight: deque[PendingOutput] = deque()
        # A step still running on the device, or a background warm-up's compile, when the interpreter
        # exits makes it abort (SIGABRT): wait for them then, or when the engine is dropped.
        self._finalizer = weakref.finalize(self, _wait_for, self._in_flight, self.runner)
        self._thaw: Callable[[], object] = lambda: None  # what hands warm-up's frozen objects back to the collector
        if warms_now:
            self.warm_up()

    def warm_up(self) -> None:
        """Compile every program a step can run (`Runner.warmup`), showing the progress, then, on a
        GPU, run each once (`Runner.run_each_once`) unless warm-up compiled none; once.

        The KV cache is let go while the programs compile and made again after: XLA's autotuner
        allocates device buffers as it compiles, beyond what KV sizing set aside. The first run of a
        GPU program holds the host while its kernels load; on XLA:CPU a first run costs little more
        than a later one, and running every program would only lengthen each start. A start whose
        warm-up compiled none (it found them in the program cache, or a runner before it made them)
        serves at once: its first runs would cost it more than they spare the first steps
        (docs/benchmarks.md)."""
        if self.warm:
            return
        del self.state
        report = self.runner.warmup(WarmupProgress(), background=self.args.compile_in_background)
        start = time.perf_counter()
        with self._out_of_memory_named("making the KV cache again after the compiles"):
            self.state = self.runner.init_state()
        if platform.on_gpu() and report["compiled"] > report["loaded_from_cache"]:
            with self._out_of_memory_named("running each program once"):
                self.state = self.runner.run_each_once(self.state)
        self.startup = report = {**self._phases, **report, "first_runs_seconds": round(time.perf_counter() - start, 2)}
        logger.info("loaded in %.1f s (and %d programs, %.1f s after), sized the KV cache in %.1f s, compiled %d programs "
                    "in %.1f s (%.1f s lowering), ran each once in %.1f s; KV cache: %d blocks, %d tokens, %.2f GiB",
                    report["load_seconds"], report["loaded_ahead"], report["ahead_wait_seconds"],
                    report["kv_sizing_seconds"], report["compiled"], report["compile_seconds"], report["lowering_seconds"],
                    report["first_runs_seconds"], report["kv_cache_blocks"], report["kv_cache_tokens"], report["kv_cache_gib"])
        _freeze_objects()
        self._thaw = weakref.finalize(self, _thaw_objects)
        self.warm = True

    @contextlib.contextmanager
    def _out_of_memory_named(self, doing: str) -> Iterator[None]:
        """The device running out of memory at start-up raised as an error that names the KV cache's
        size and what sets it, not as XLA's allocator failing deep in a program."""
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            cfg, args, gib = self.config, self.args, 2**30
            cache = kv_cache_bytes(self.model_config, cfg, self.runner.draft_model) / gib
            sized = (f"num_gpu_blocks_override={args.num_gpu_blocks_override}" if args.num_gpu_blocks_override
                     else f"gpu_memory_utilization={args.gpu_memory_utilization}")
            stats = platform.memory_stats(cfg.data_parallel_rank * cfg.tensor_parallel_size)
            pool = "" if not stats else (
                f"; the device's pool then: {stats['bytes_in_use'] / gib:.2f} of {stats['bytes_limit'] / gib:.2f} GiB "
                f"in use, its largest free block {stats.get('largest_free_block_bytes', 0) / gib:.2f} GiB")
            raise MemoryError(f"the device ran out of memory {doing}, with a KV cache of {cfg.num_blocks} blocks "
                              f"({cache:.2f} GiB) set by {sized}{pool}: lower gpu_memory_utilization or set "
                              "num_gpu_blocks_override to fewer blocks") from e

    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> ProcessedPrompt:
        """`prompt` tokenized and checked by `self.processor` (see `Processor.process`)."""
        return self.processor.process(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams | None = None,
        *,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request, with `lora_request`'s adapter if given. With `delta`, each output carries
        only what is new since the last one. Everything is checked before anything is queued: a
        ValueError leaves the engine as it was. An adapter that cannot be read, or does not fit
        (its rank, its modules), fails this request alone."""
        self._check_open()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if lora_request is not None and not self.config.lora.enabled:
            raise ValueError("a LoRA request needs LoRA on: pass enable_lora=True (--enable-lora)")
        inputs = (
            prompt if isinstance(prompt, ProcessedPrompt)
            else self.process_prompt(prompt, params or SamplingParams(**self.sampling_defaults))
        )
        if lora_request is not None and inputs.error is None:
            try:
                self.runner.add_lora(lora_request)
            except ValueError as e:
                inputs = dataclasses.replace(inputs, error=str(e))
        parent = _Parent(request_id, inputs, delta)
        if inputs.error is not None:
            logger.warning("request %s failed: %s", request_id, inputs.error)
            self._ready.append(self._output(parent))
            return
        sp = inputs.sampling_params
        room = self.config.max_model_len - len(inputs.prompt_token_ids)
        for i in range(sp.n):
            child_params = dataclasses.replace(
                sp,
                n=1,
                seed=None if sp.seed is None else sp.seed + i,
                prompt_logprobs=sp.prompt_logprobs if i == 0 else None,
            )
            request = Request(
                req_id=request_id if sp.n == 1 else f"{i}_{request_id}",
                prompt_token_ids=inputs.prompt_token_ids,
                sampling_params=child_params,
                max_tokens=room if sp.max_tokens is None else sp.max_tokens,
                eos_token_ids=frozenset() if sp.ignore_eos else frozenset(self.model_config.eos_token_ids),
                lora_request=lora_request,
            )
            detok = (
                None
                if self.tokenizer is None
                else IncrementalDetokenizer(self.tokenizer, inputs.prompt_token_ids, child_params)
            )
            child = _Child(request, detok)
            if sp.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            parent.children.append(child)
        if clash := [c.request.req_id for c in parent.children if c.request.req_id in self._children]:
            raise ValueError(f"request ids {clash} are already in use")
        for child in parent.children:
            self._children[child.request.req_id] = (parent, child)
        self._parents[request_id] = parent
        if sp.structured_outputs is None:
            for child in parent.children:
                self.scheduler.add_request(child.request)
            return
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self._compiling.append((parent, self._grammars.compile(sp.structured_outputs)))

    def abort_request(self, request_ids: Iterable[str], final_output: bool = True) -> None:
        """End requests wherever they are (waiting, running, or with a step in flight) and free their
        blocks. With `final_output`, each gets a last output (finish_reason "abort"), returned by the
        next `step()`, so that whoever streams it sees it end. Unknown or finished ids are ignored."""
        for request_id in list(request_ids):
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                if child.request.req_id in self.scheduler.requests:
                    self.scheduler.finish_requests([child.request.req_id], RequestStatus.FINISHED_ABORTED)
                elif not child.request.is_finished:  # its grammar was still compiling
                    child.request.status = RequestStatus.FINISHED_ABORTED
                del self._children[child.request.req_id]
            if final_output:
                self._ready.append(self._output(parent))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (vLLM's `add_lora`); a ValueError says
        what is wrong with it."""
        self._check_open()
        if not self.config.lora.enabled:
            raise ValueError("add_lora needs LoRA on: pass enable_lora=True (--enable-lora)")
        self.runner.add_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests already running with it finish with it."""
        running = {r.lora_request.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}
        if lora_id in running:
            raise ValueError(f"LoRA adapter {lora_id} is in use by running requests; remove it once they finish")
        return self.runner.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.runner.list_loras()}

    def has_unfinished_requests(self) -> bool:
        return bool(self._ready or self._compiling) or self.scheduler.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        """Requests added and not yet finished (with an output still to return)."""
        return len(self._parents)

    def step(self) -> list[RequestOutput]:
        """Dispatch one scheduled batch, then take the output of the batch before it (async
        scheduling: the device runs this step while the host works on the last one's tokens), or of
        this one; the outputs of requests that progressed or finished.

        A batch with structured requests is dispatched in two halves: the forward pass, then the
        sampling under the grammar masks. The masks need the grammars past the tokens of every step
        before, so those are taken in between, while the device runs the forward pass; their text
        and outputs wait until the sampling is queued."""
        self._check_open()
        outputs, self._ready = self._ready + self._admit_compiled(), []
        scheduled = False
        if self.scheduler.has_unfinished_requests():
            sched = self.scheduler.schedule()
            self.state = self.runner.execute_model(self.state, sched)
            taken, masks = [], None
            if sched.structured_output_request_ids:
                while self._in_flight:
                    out = self._in_flight.popleft().get()
                    taken.append((out, self.scheduler.update_from_output(out)))
                masks = self.scheduler.grammar_bitmask(sched)
            self.state, pending = self.runner.sample_tokens(self.state, masks)
            self._in_flight.append(pending)
            for out, new_tokens in taken:
                outputs += self._emit(out, new_tokens)
            scheduled = sched.total_num_scheduled_tokens > 0
        while len(self._in_flight) > (1 if self.args.async_scheduling and scheduled else 0):
            outputs += self._process(self._in_flight.popleft().get())
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the requests whose grammar compiled to the scheduler, each child with its own copy,
        and fail those whose grammar did not; wait for a grammar when nothing else can run."""
        if not self._compiling:
            return []
        if not (self.scheduler.has_unfinished_requests() or self._in_flight):
            wait([future for _, future in self._compiling], return_when=FIRST_COMPLETED)
        outputs, waiting = [], []
        for parent, future in self._compiling:
            if self._parents.get(parent.request_id) is not parent:
                continue  # aborted meanwhile
            if not future.done():
                waiting.append((parent, future))
                continue
            try:
                template = future.result()
            except Exception as e:  # the request fails alone, whatever broke its grammar
                logger.warning("request %s failed: %s", parent.request_id, e)
                for child in parent.children:
                    child.request.status, child.request.error = RequestStatus.FINISHED_ERROR, str(e)
                    del self._children[child.request.req_id]
                del self._parents[parent.request_id]
                outputs.append(self._output(parent))
                continue
            for child in parent.children:
                child.request.grammar = new_grammar(template)
                self.scheduler.add_request(child.request)
        self._compiling = waiting
        return outputs

    def drain(self) -> None:
        """Wait for every dispatched step and take its output (returned by the next `step()`), so
        that nothing is left running on the device."""
        while self._in_flight:
            self._ready += self._process(self._in_flight.popleft().get())

    def close(self) -> None:
        """Finish what is in flight, abort every request left and take no more work."""
        if self._closed:
            return
        self.drain()
        self.abort_request(list(self._parents), final_output=False)
        if self._grammars is not None:
            self._grammars.shutdown()
        self._finalizer()
        self._thaw()
        self._closed = True

    def stats(self) -> EngineStats:
        cache, host, copies = self.block_manager.stats, self.block_manager.host_tier, self.runner.host_kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_nans_in_logits=self.scheduler.num_nans_in_logits,
            kv_offload_hits=host.stats.hits if host is not None else 0,
            kv_offload_bytes_saved=copies.stats.bytes_saved if copies is not None else 0,
            kv_offload_bytes_loaded=copies.stats.bytes_loaded if copies is not None else 0,
            kv_offload_seconds=copies.stats.seconds if copies is not None else 0.0,
            spec_decoding=self.scheduler.spec_stats.as_dict() if self.config.speculative.enabled else {},
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was closed; create a new one")

    def _process(self, out: RunnerOutput) -> list[RequestOutput]:
        return self._emit(out, self.scheduler.update_from_output(out))

    def _emit(self, out: RunnerOutput, new_tokens: dict[str, list[int]]) -> list[RequestOutput]:
        """Logprobs, text and stop strings of the requests that progressed, and their outputs."""
        progressed: dict[str, _Parent] = {}
        for req_id, tokens in new_tokens.items():
            parent, child = self._children[req_id]
            self._add_logprobs(parent, child, out, len(tokens))
            self._detokenize(child, tokens)
            progressed[parent.request_id] = parent
        outputs = []
        for parent in progressed.values():
            outputs.append(self._output(parent))
            if all(c.request.is_finished for c in parent.children):
                del self._parents[parent.request_id]
                for c in parent.children:
                    del self._children[c.request.req_id]
        return outputs

    def _add_logprobs(self, parent: _Parent, child: _Child, out: RunnerOutput, num_tokens: int) -> None:
        """Keep the rows of the `num_tokens` tokens the child kept, and its prompt logprobs if given."""
        req_id = child.request.req_id
        if child.logprobs is not None and num_tokens:
            rows = out.logprobs[req_id]
            child.logprobs += self._logprob_dicts(rows)[:num_tokens]
            child.cumulative_logprob += sum(rows.logprobs[:num_tokens, 0].tolist())
        if req_id in out.prompt_logprobs_dict:
            parent.prompt_logprobs = [None, *self._logprob_dicts(out.prompt_logprobs_dict[req_id])]

    def _logprob_dicts(self, rows: LogprobsArrays) -> list[dict[int, Logprob]]:
        """One dict per row: the chosen token with its rank, then the top N with ranks 1..N; a chosen
        token among the top N has one entry (the top-N one), as in vLLM."""
        dicts = []
        for ids, values, rank in zip(rows.token_ids.tolist(), rows.logprobs.tolist(), rows.ranks.tolist()):
            ranks = [rank, *range(1, len(ids))]
            dicts.append({t: Logprob(v, r, self._token_text(t)) for t, v, r in zip(ids, values, ranks)})
        return dicts

    def _token_text(self, token_id: int) -> str | None:
        """A logprob's decoded_token: the id decoded alone, as in vLLM (None without a tokenizer).
        Cached: the same ids come back in every top N."""
        if self.tokenizer is None:
            return None
        if token_id not in self._token_texts:
            self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return self._token_texts[token_id]

    def _detokenize(self, child: _Child, tokens: list[int]) -> None:
        request = child.request
        if child.detokenizer is None:
            return
        stop = child.detokenizer.update(tokens, request.stopped_on_token)
        if stop is None:
            return
        request.stop_reason = stop
        if request.is_finished:  # max_tokens ended it on the same token: the stop string wins, as in vLLM
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_STOPPED)

    def _output(self, parent: _Parent) -> RequestOutput:
        inputs = parent.inputs
        if inputs.error is not None:
            return RequestOutput(
                request_id=parent.request_id,
                prompt=inputs.prompt,
                prompt_token_ids=inputs.prompt_token_ids,
                outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
                finished=True,
                error=inputs.error,
            )
        completions = []
        for index, child in enumerate(parent.children):
            request, finished = child.request, child.request.is_finished
            start = child.num_sent_tokens if parent.delta else 0
            if parent.delta and start == request.num_output_tokens and finished == child.sent_finished:
                continue
            child.num_sent_tokens, child.sent_finished = request.num_output_tokens, finished
            text = "" if child.detokenizer is None else child.detokenizer.text(finished, parent.delta)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=request.output_token_ids[start:],
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=None if child.logprobs is None else child.logprobs[start:],
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_nans_in_logits=request.num_nans_in_logits,
                )
            )
        prompt_logprobs = parent.prompt_logprobs
        if parent.delta:  # vLLM's delta outputs carry them once
            parent.prompt_logprobs = None
        errors = [f"completion {i}: {c.request.error}" if len(parent.children) > 1 else c.request.error
                  for i, c in enumerate(parent.children) if c.request.error]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=inputs.prompt,
            prompt_token_ids=inputs.prompt_token_ids,
            outputs=completions,
            finished=all(c.request.is_finished for c in parent.children),
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(parent.children[0].request.num_cached_tokens, 0),
            error="; ".join(errors) or None,
        )


_frozen_by = 0  # open engines that froze the collector's objects: the last to go hands them back


def _freeze_objects() -> None:
    """Warm-up leaves hundreds of thousands of objects (traced programs, executables) that every
    full collection would walk, holding up a step's host work far longer than the step takes: they
    stay out of the collector's way (gc.freeze, as vLLM does) until the last engine that froze them
    goes. The freeze is the process's; objects alive now that later become garbage in a cycle wait
    for that too."""
    global _frozen_by
    gc.collect()
    gc.freeze()
    _frozen_by += 1


def _thaw_objects() -> None:
    global _frozen_by
    _frozen_by -= 1
    if _frozen_by == 0:
        gc.unfreeze()


def _wait_for(in_flight: deque[PendingOutput], runner: Runner) -> None:
    for pending in in_flight:
        pending.get()
    runner.stop_warmup()
