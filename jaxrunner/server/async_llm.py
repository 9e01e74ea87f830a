"""AsyncLLM: one engine stepped by a thread of its own, serving many asyncio clients.

The engine (its scheduler, runner and detokenizers) belongs to that thread alone. The event loop
hands it work through a queue (a request to add, one to abort, the order to stop); the thread takes
the queue between two steps, so requests join and leave there, and blocks on it when nothing runs.
Each step's outputs go back to the loop in one call and land in one asyncio queue per request. A
client that reads slower than the engine steps gets the deltas that piled up merged into one.

Prompts are tokenized and chats rendered on a pool of worker threads, each with its own copy of the
engine's `Processor`, so a long prompt or a slow template delays its own request and never a step.
A request the engine cannot run raises ValueError from `add_request`, so a server can answer it
with an error before any output; its prompt plus `max_tokens` must fit the model length (an OpenAI
server refuses such a request rather than cut it short). Any other error while one request is
taken is that request's alone: it reaches its caller, and the engine steps on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jaxrunner.engine.chat import Conversation
from jaxrunner.engine.engine import LLMEngine
from jaxrunner.engine.processor import ProcessedPrompt, Processor, Prompt
from jaxrunner.engine.outputs import EngineStats, RequestOutput
from jaxrunner.lora_request import LoRARequest
from jaxrunner.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered with the tokenizer's chat template (or `chat_template`) on a worker."""

    messages: Conversation
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class _Add:
    request_id: str
    inputs: ProcessedPrompt
    accepted: asyncio.Future  # done on the loop: the number of prompt tokens, or the error
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], object]
    done: asyncio.Future  # done on the loop: fn's result, or its error


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineDeadError(RuntimeError):
    """The engine's thread stopped on an error: no request can run any more."""


class StepObserver:
    """What `AsyncLLM` tells, from the engine's thread (metrics use it); the default does nothing."""

    def added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        pass

    def aborted(self, request_id: str) -> None:
        pass

    def stepped(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        pass


class RequestStream:
    """The delta outputs of one request, as an async iterator; the last one has `finished` set.
    `close()` aborts the request if it is still running."""

    def __init__(self, llm: AsyncLLM, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id, self.num_prompt_tokens = request_id, num_prompt_tokens
        self._llm, self._finished, self._closed = llm, False, False
        self._queue = llm._streams[request_id]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        out = await self._queue.get()
        while not self._queue.empty() and isinstance(out, RequestOutput) and not out.finished:
            out = merge_outputs(out, self._queue.get_nowait())
        if isinstance(out, BaseException):
            self.close()
            raise EngineDeadError(f"the engine stopped: {out!r}") from out
        self._finished = out.finished
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._llm._streams.pop(self.request_id, None)
        if not self._finished:
            self._llm._commands.put(_Abort(self.request_id))


class AsyncLLM:
    """`workers`: the threads that tokenize and render prompts."""

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None,
                 workers: int = min(4, os.cpu_count() or 1)) -> None:
        self.engine = engine
        self.observer = observer or StepObserver()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="jaxrunner-engine", daemon=True)
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="jaxrunner-prompts")
        self._processors = threading.local()
        self._stopping = False
        self.error: BaseException | None = None  # why the engine's thread stopped, if it failed

    def start(self) -> None:
        """Start stepping; call from the event loop the streams are read on."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def add_request(self, request_id: str, prompt: Prompt | ChatPrompt, params: SamplingParams,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request (with `lora_request`'s adapter); its stream once the engine took it.
        ValueError when it cannot run, its adapter included."""
        self._check_running()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        inputs = await self._loop.run_in_executor(self._workers, self._process, prompt, params)
        if inputs.error is not None:
            raise ValueError(inputs.error)
        _check_length(len(inputs.prompt_token_ids), params.max_tokens, self.engine.config.max_model_len)
        self._check_running()  # again: the engine may have stopped while the prompt was processed
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = asyncio.Queue()
        accepted = self._loop.create_future()
        self._commands.put(_Add(request_id, inputs, accepted, lora_request))
        try:
            num_prompt_tokens = await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            if accepted.cancelled() or not accepted.done():  # cancelled: the engine may have taken it
                self._commands.put(_Abort(request_id))
            raise
        return RequestStream(self, request_id, num_prompt_tokens)

    async def call(self, fn: Callable[[LLMEngine], object]):
        """fn(engine) on the engine's thread, between two steps (adding an adapter, say); its result,
        or the error it raised."""
        self._check_running()
        done = self._loop.create_future()
        self._commands.put(_Call(fn, done))
        return await done

    async def close(self) -> None:
        """Take no more requests, run those in flight to their end, then close the engine."""
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._stopping = True
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join)

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running" + (f": {self.error!r}" if self.error else ""))

    def _process(self, prompt: Prompt | ChatPrompt, params: SamplingParams) -> ProcessedPrompt:
        """On a worker thread, with that thread's own processor."""
        processor: Processor | None = getattr(self._processors, "processor", None)
        if processor is None:
            processor = self._processors.processor = self.engine.processor.copy()
        if isinstance(prompt, ChatPrompt):
            prompt = processor.render_chat(prompt.messages, prompt.chat_template, prompt.add_generation_prompt,
                                           prompt.continue_final_message)[0]
        return processor.process(prompt, params)

    def _run(self) -> None:
        engine = self.engine
        try:
            engine.warm_up()  # a server's engine compiles here, its port open (requests wait in the queue)
            stop = False
            while not (stop and not engine.has_unfinished_requests()):
                commands = self._take_commands(block=not engine.has_unfinished_requests())
                for command in commands:
                    if command is None:
                        stop = True
                    elif isinstance(command, _Add):
                        self._add(command, refuse=stop)
                    elif isinstance(command, _Call):
                        self._call(command)
                    else:
                        engine.abort_request([command.request_id], final_output=False)
                        self.observer.aborted(command.request_id)
                if not engine.has_unfinished_requests():  # idle: the snapshot shows it (aborts freed blocks)
                    self.observer.stepped([], engine.stats(), time.monotonic())
                    continue
                outputs = engine.step()
                self.observer.stepped(outputs, engine.stats(), time.monotonic())
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # a bug or a device failure: every stream and waiting caller hears of it
            self.error = e
            self._stopping = True
            self._loop.call_soon_threadsafe(self._fail, e)
        finally:
            self._stopping = True
            engine.close()

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Add, refuse: bool) -> None:
        """Every error is the request's: ValueError for one the engine cannot run, anything else a bug
        its caller reports (the engine is left as it was: `add_request` checks before it queues)."""
        engine, result = self.engine, None
        try:
            if refuse:
                raise ValueError("the server is shutting down")
            if command.lora_request is not None:
                engine.add_lora(command.lora_request)  # a bad adapter is the request's error, before it starts
            engine.add_request(command.request_id, command.inputs, delta=True, lora_request=command.lora_request)
            self.observer.added(command.request_id, len(command.inputs.prompt_token_ids), time.monotonic())
            result = len(command.inputs.prompt_token_ids)
        except Exception as e:
            result = e
        self._loop.call_soon_threadsafe(_settle, command.accepted, result)

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as e:
            result = e
        self._loop.call_soon_threadsafe(_settle, command.done, result)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            if (stream := self._streams.get(out.request_id)) is not None:
                stream.put_nowait(out)

    def _fail(self, error: BaseException) -> None:
        """On the loop, after the engine's thread stopped: streams get the error, and the commands it
        never took fail their callers."""
        for stream in self._streams.values():
            stream.put_nowait(error)
        dead = EngineDeadError(f"the engine stopped: {error!r}")
        for command in self._take_commands(block=False):
            if isinstance(command, (_Add, _Call)):
                _settle(command.accepted if isinstance(command, _Add) else command.done, dead)


def _settle(future: asyncio.Future, result) -> None:
    if future.cancelled():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} prompt tokens "
            f"plus max_tokens={max_tokens} ask for {num_prompt_tokens + max_tokens}: shorten the prompt or lower max_tokens"
        )


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two delta outputs of one request as one: each completion's new text, tokens and logprobs
    joined, the later state otherwise."""
    if isinstance(later, BaseException):
        return later
    completions = {c.index: c for c in first.outputs}
    for c in later.outputs:
        if (before := completions.get(c.index)) is not None:
            c = dataclasses.replace(
                c, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
                logprobs=None if c.logprobs is None else (before.logprobs or []) + c.logprobs)
        completions[c.index] = c
    return dataclasses.replace(later, outputs=sorted(completions.values(), key=lambda c: c.index),
                               prompt_logprobs=first.prompt_logprobs or later.prompt_logprobs)
