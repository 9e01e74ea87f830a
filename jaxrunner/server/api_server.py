"""The OpenAI-compatible HTTP server: FastAPI routes over one `AsyncLLM`.

    jaxrunner serve                      # the default model on http://127.0.0.1:8000
    jaxrunner serve DIR --host 0.0.0.0 --port 8080 --api-key KEY

Routes: /v1/completions, /v1/chat/completions (the tokenizer's chat template), /v1/models, /health,
/metrics. With LoRA on, `model` names the base model or an adapter: those of `--lora-modules`, and,
with `--allow-runtime-lora-updating`, those added while serving through /v1/load_lora_adapter (from
under `--lora-roots` only) and dropped by /v1/unload_lora_adapter. `stream: true` answers with
server-sent events, `[DONE]` last. Every error has OpenAI's body ({"error": {"message", "type",
"param", "code"}}): 400 for a malformed body, a bad parameter or a prompt that does not fit, 401
without the API key, 404 for an unknown model or route, 413 for a body over the limit, 500 for a
bug met while serving one request (the others go on). A request is checked and taken by the engine
before its response starts, so a stream never begins for a request that cannot run; a client that
goes away aborts its requests and frees their blocks. SIGTERM stops taking connections and lets
open ones finish; the engine then runs what it holds to the end, and the process exits with 0.
`guards.py` holds what keeps hostile or careless clients from the engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from jaxrunner.engine.default_model import TINY_MODEL
from jaxrunner.engine.data_parallel import make_engine
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.engine.model_files import DEFAULT_MODEL, default_gguf
from jaxrunner.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxrunner.lora_request import LoRARequest
from jaxrunner.server.async_llm import AsyncLLM, ChatPrompt, EngineDeadError, RequestStream, merge_outputs
from jaxrunner.server.guards import ApiKey, BoundedBody, LastResort, TimedHttpProtocol, error_body, error_response
from jaxrunner.server.metrics import ServerMetrics
from jaxrunner.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    SamplingFields,
    UnloadLoRAAdapterRequest,
)

DISCONNECT_POLL_S = 0.25
logger = logging.getLogger("jaxrunner.server")


@dataclass(frozen=True)
class ServerOptions:
    """How the server meets its clients; the defaults are safe to expose.

    `api_key`: wanted on every /v1/ route (None: open). `max_request_body_bytes`: larger bodies get
    a 413 (the 32 MiB vLLM's HTTP front end takes). `read_timeout_s`: for a request's headers, and
    again for its body. `keep_alive_s`: an idle connection's life between requests.
    `trust_request_chat_template`: let a request bring its own `chat_template` (code the server
    runs). `allow_runtime_lora_updating`: the /v1/load_lora_adapter and /v1/unload_lora_adapter
    routes, which read adapters from under `lora_roots` alone (symbolic links resolved first).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    max_request_body_bytes: int = 32 * 2**20
    read_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    trust_request_chat_template: bool = False
    allow_runtime_lora_updating: bool = False
    lora_roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.allow_runtime_lora_updating and not self.lora_roots:
            raise ValueError("--allow-runtime-lora-updating needs --lora-roots: the directories adapters may be loaded from")
        if self.lora_roots and not self.allow_runtime_lora_updating:
            raise ValueError("--lora-roots is for adapters loaded while serving: add --allow-runtime-lora-updating")
        if missing := [root for root in self.lora_roots if not os.path.isdir(root)]:
            raise ValueError(f"--lora-roots: {missing} are not directories")
        if self.max_request_body_bytes < 1 or self.read_timeout_s <= 0 or self.keep_alive_s <= 0:
            raise ValueError("the body limit and the timeouts must be positive")
        object.__setattr__(self, "lora_roots", tuple(os.path.realpath(root) for root in self.lora_roots))


class ModelNotFound(Exception):
    pass


def serve(args: EngineArgs, options: ServerOptions = ServerOptions()) -> None:
    """Load the engine and the adapters of `options.lora_modules` (name: PEFT directory); a bad
    model, argument or adapter fails here, before the port opens. Then serve until SIGINT or SIGTERM;
    the programs compile once the port is open, /health answering 503 "starting" until they are
    ready (requests sent meanwhile wait)."""
    import uvicorn

    if options.allow_runtime_lora_updating and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    name = options.served_model_name or args.model or (DEFAULT_MODEL if default_gguf() is not None else TINY_MODEL)
    engine = make_engine(args, defer_warm_up=True)
    loras = [LoRARequest(lora, i, path) for i, (lora, path) in enumerate(options.lora_modules.items(), 1)]
    for lora in loras:
        engine.add_lora(lora)
    metrics = ServerMetrics(name)
    app = build_app(AsyncLLM(engine, metrics), metrics, name, options, loras)
    # uvicorn raises the SIGTERM it handled again once it has shut down; by then every request was
    # answered and the engine drained, which is a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=options.host, port=options.port, log_level="info", timeout_keep_alive=options.keep_alive_s,
                http=functools.partial(TimedHttpProtocol, read_timeout_s=options.read_timeout_s))


def build_app(llm: AsyncLLM, metrics: ServerMetrics, model_name: str, options: ServerOptions = ServerOptions(),
              loras: list[LoRARequest] = ()) -> FastAPI:
    """The app; its lifespan starts the engine's thread and, at shutdown, drains it. `loras`: the
    adapters `model` may name (added to the engine already)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        yield
        await llm.close()

    app = FastAPI(title="jaxrunner", lifespan=lifespan)
    app.add_middleware(BoundedBody, max_bytes=options.max_request_body_bytes, timeout_s=options.read_timeout_s)
    if options.api_key is not None:
        app.add_middleware(ApiKey, key=options.api_key)
    app.add_middleware(LastResort)

    adapters = {lora.lora_name: lora for lora in loras}

    def check_model(name: str | None) -> tuple[str, LoRARequest | None]:
        """The name replies carry, and the adapter `name` asks for."""
        if name is None or name == model_name:
            return model_name, None
        if name in adapters:
            return name, adapters[name]
        served = ", ".join(repr(n) for n in [model_name, *adapters])
        raise ModelNotFound(f"the model {name!r} does not exist; this server serves {served}")

    @app.get("/health")
    async def health() -> Response:
        if llm.is_running and not llm.engine.warm:
            return error_response(503, "ServiceUnavailableError", "the engine is starting: its programs are "
                                  "compiling (warm-up); requests sent now wait for it")
        if llm.is_running:
            return Response(status_code=200)
        return error_response(503, "ServiceUnavailableError", f"the engine is not running: {llm.error!r}")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        created, max_len = int(time.time()), llm.engine.config.max_model_len
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "jaxrunner", "max_model_len": max_len}
        lora_cards = [{"id": a.lora_name, "object": "model", "created": created, "owned_by": "jaxrunner",
                       "root": a.lora_name, "parent": model_name, "max_model_len": max_len} for a in adapters.values()]
        return {"object": "list", "data": [card, *lora_cards]}

    if options.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            if body.lora_name in adapters or body.lora_name == model_name:
                raise ValueError(f"the name {body.lora_name!r} is taken; unload that adapter first or choose another name")
            path = _under_roots(body.lora_path, options.lora_roots)
            lora = LoRARequest(body.lora_name, max((a.lora_int_id for a in adapters.values()), default=0) + 1, path)
            adapters[lora.lora_name] = lora  # the id is taken while the engine reads the files
            try:
                await llm.call(lambda engine: engine.add_lora(lora))
            except BaseException:
                del adapters[lora.lora_name]
                raise
            return Response(f"LoRA adapter {lora.lora_name!r} added", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            lora = adapters.get(body.lora_name)
            if lora is None:
                raise ModelNotFound(f"no LoRA adapter named {body.lora_name!r}")
            await llm.call(lambda engine: engine.remove_lora(lora.lora_int_id))
            del adapters[lora.lora_name]
            return Response(f"LoRA adapter {lora.lora_name!r} removed", media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        name, lora = check_model(body.model)
        params = body.to_sampling_params(llm.engine.sampling_defaults)
        reply = _Reply(f"cmpl-{uuid.uuid4().hex}", "text_completion", name, body, params.n)
        streams = await _add(llm, reply.id, body.prompts(), params, lora)
        if body.stream:
            return _EventStream(reply.completion_events(streams), streams)
        outputs = await _until_disconnected(request, streams)
        return _failed(outputs) or JSONResponse(reply.completion(outputs, streams))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        name, lora = check_model(body.model)
        params = body.to_sampling_params(llm.engine.sampling_defaults)
        if body.chat_template is not None and not options.trust_request_chat_template:
            raise ValueError("this server takes no chat_template from requests (a template is code the server runs); "
                             "leave the field out to use the model's, or start the server with --trust-request-chat-template")
        prompt = ChatPrompt([m.as_dict() for m in body.messages], body.chat_template, body.add_generation_prompt,
                            body.continue_final_message)
        reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", name, body, params.n)
        streams = await _add(llm, reply.id, [prompt], params, lora)
        if body.stream:
            return _EventStream(reply.chat_events(streams[0]), streams)
        outputs = await _until_disconnected(request, streams)
        return _failed(outputs) or JSONResponse(reply.chat(outputs[0], streams))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"the body is not valid JSON ({err['ctx']['error']})" if err["type"] == "json_invalid"
                             else f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}"
                             for err in e.errors())
        return error_response(400, "BadRequestError", problems or "malformed request body")

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, e: ValueError) -> JSONResponse:
        return error_response(400, "BadRequestError", str(e))

    @app.exception_handler(ModelNotFound)
    async def unknown_model(request: Request, e: ModelNotFound) -> JSONResponse:
        return error_response(404, "NotFoundError", str(e))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, "ServiceUnavailableError", str(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(e.status_code, "NotFoundError" if e.status_code == 404 else "HTTPError", str(e.detail))

    return app


def _under_roots(path: str, roots: tuple[str, ...]) -> str:
    """`path` with its links resolved, if that lies under one of `roots`. The error is the same
    whether the path exists or not, so a client learns nothing of the files outside the roots."""
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ValueError(f"no adapter may be loaded from {path!r}: give a directory under the server's --lora-roots")
    return real


def _failed(outputs: list[RequestOutput] | None) -> Response | None:
    """The response when the client left (499), or when a request failed before its first token
    (a grammar that does not compile: 400); None otherwise. A failure later, such as NaN logits,
    stays a choice with finish_reason "error"."""
    if outputs is None:
        return Response(status_code=499)
    if failed := [o.error for o in outputs if o.error and not any(c.token_ids for c in o.outputs)]:
        return error_response(400, "BadRequestError", "; ".join(failed))
    return None


async def _add(llm: AsyncLLM, reply_id: str, prompts: list, params, lora: LoRARequest | None) -> list[RequestStream]:
    """Every prompt taken by the engine, or none (the others are aborted and the error raised)."""
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await llm.add_request(f"{reply_id}-{i}", prompt, params, lora))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def _collect(stream: RequestStream) -> RequestOutput:
    final = None
    async for out in stream:
        final = out if final is None else merge_outputs(final, out)
    return final


async def _until_disconnected(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The final outputs, or None when the client left first (its requests aborted)."""
    tasks = [asyncio.ensure_future(_collect(s)) for s in streams]
    try:
        while True:
            _, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            if not pending or any(t.exception() for t in tasks if t.done()):
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                return None
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def _interleaved(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as each stream yields them."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
        except BaseException as e:
            merged.put_nowait((i, e))
        finally:
            merged.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await merged.get()
            if out is None:
                left -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()


class _EventStream(StreamingResponse):
    """Server-sent events that abort their requests however the response ends (a client that goes
    away makes the next send fail, and Starlette leaves the body unclosed then)."""

    def __init__(self, events: AsyncIterator[dict], streams: list[RequestStream]) -> None:
        super().__init__(_sse(events), media_type="text/event-stream")
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()
            await self.body_iterator.aclose()


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
    except EngineDeadError as e:
        yield f"data: {json.dumps(error_body(503, 'ServiceUnavailableError', str(e)))}\n\n"
    yield "data: [DONE]\n\n"


class _Reply:
    """One response's identity and options, and the OpenAI shapes of its outputs."""

    def __init__(self, reply_id: str, kind: str, model: str, body: SamplingFields, n: int) -> None:
        self.id, self.kind, self.model, self.body, self.n = reply_id, kind, model, body, n
        self.created = int(time.time())
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, streams: list[RequestStream], completion_tokens: int) -> dict:
        prompt_tokens = sum(s.num_prompt_tokens for s in streams)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def completion(self, outputs: list[RequestOutput], streams: list[RequestStream]) -> dict:
        choices, tokens = [], 0
        for i, out in enumerate(outputs):
            for c in out.outputs:
                echo = out.prompt if self.body.echo else ""
                choices.append({"index": i * self.n + c.index, "text": echo + c.text,
                                "logprobs": self._completion_logprobs(c, 0), "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
                tokens += len(c.token_ids)
        choices.sort(key=lambda choice: choice["index"])
        return {**self._head(self.kind), "choices": choices, "usage": self._usage(streams, tokens)}

    async def completion_events(self, streams: list[RequestStream]) -> AsyncIterator[dict]:
        offsets: dict[int, int] = {}  # choice index -> characters sent (logprobs' text_offset)
        tokens = 0
        async for i, out in _interleaved(streams):
            for c in out.outputs:
                index = i * self.n + c.index
                text = (out.prompt if self.body.echo and index not in offsets else "") + c.text
                logprobs = self._completion_logprobs(c, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(text)
                tokens += len(c.token_ids)
                yield {**self._head(self.kind), "choices": [
                    {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason}]}
            if out.error:
                yield error_body(400, "BadRequestError", out.error)
        if self.include_usage:
            yield {**self._head(self.kind), "choices": [], "usage": self._usage(streams, tokens)}

    def chat(self, out: RequestOutput, streams: list[RequestStream]) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        tokens = sum(len(c.token_ids) for c in out.outputs)
        return {**self._head(self.kind), "choices": choices, "usage": self._usage(streams, tokens)}

    async def chat_events(self, stream: RequestStream) -> AsyncIterator[dict]:
        kind, tokens = "chat.completion.chunk", 0
        for index in range(self.n):
            yield {**self._head(kind), "choices": [
                {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        async for out in stream:
            for c in out.outputs:
                tokens += len(c.token_ids)
                yield {**self._head(kind), "choices": [
                    {"index": c.index, "delta": {"content": c.text}, "logprobs": self._chat_logprobs(c),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
            if out.error:
                yield error_body(400, "BadRequestError", out.error)
        if self.include_usage:
            yield {**self._head(kind), "choices": [], "usage": self._usage([stream], tokens)}

    def _completion_logprobs(self, c: CompletionOutput, offset: int) -> dict | None:
        """The legacy completions shape: parallel lists, top_logprobs keyed by token text."""
        if c.logprobs is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entries in zip(c.token_ids, c.logprobs):
            text = _text(token_id, entries[token_id])
            tokens.append(text)
            values.append(entries[token_id].logprob)
            tops.append({_text(t, lp): lp.logprob for t, lp in entries.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, c: CompletionOutput) -> dict | None:
        if c.logprobs is None:
            return None
        top_n = self.body.top_logprobs or 0
        content = []
        for token_id, entries in zip(c.token_ids, c.logprobs):
            ranked = sorted((lp.rank, t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= top_n)
            content.append({**_entry(token_id, entries[token_id]), "top_logprobs": [_entry(t, lp) for _, t, lp in ranked]})
        return {"content": content}


def _text(token_id: int, logprob: Logprob) -> str:
    """A token's text; `token_id:N` without a tokenizer (vLLM's form for token ids)."""
    return f"token_id:{token_id}" if logprob.decoded_token is None else logprob.decoded_token


def _entry(token_id: int, logprob: Logprob) -> dict:
    text = _text(token_id, logprob)
    return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode())}
