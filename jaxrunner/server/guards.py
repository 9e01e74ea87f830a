"""What stands between the network and the engine, as ASGI middleware and uvicorn's protocol:

- `LastResort`: any error a route did not answer fails that request alone, with a 500 whose message
  names an id the server logged the traceback under; the connection and the engine live on;
- `ApiKey`: every /v1/ route wants `Authorization: Bearer <key>` (vLLM's --api-key); /health and
  /metrics stay open for probes and scrapers;
- `BoundedBody`: a body larger than the limit is a 413 before it is parsed, and one that does not
  arrive within the read timeout a 408, so neither a huge nor a trickled body holds a worker;
- `TimedHttpProtocol`: a connection whose request headers do not arrive in time is closed (uvicorn
  bounds only the idle time between requests).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("jaxrunner.server")


def error_body(code: int, kind: str, message: str) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(code: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(code, kind, message), status_code=code)


class LastResort:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            logger.exception("request %s (%s %s) failed", error_id, scope.get("method"), scope.get("path"))
            if scope["type"] == "http" and not started:
                message = f"internal error {error_id} while serving this request; the server logged it, other requests are unaffected"
                await error_response(500, "InternalServerError", message)(scope, receive, send)


class ApiKey:
    def __init__(self, app, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                response = error_response(401, "AuthenticationError",
                                          "missing or wrong API key: send the header 'Authorization: Bearer <key>'")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BoundedBody:
    """Reads the whole body first (a route would anyway), then hands it on in one message."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        body = bytearray()
        try:
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise _TooLarge
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    if len(body) > self.max_bytes:
                        raise _TooLarge
                    if not message.get("more_body"):
                        break
        except _TooLarge:
            response = error_response(413, "RequestTooLargeError",
                                      f"the request body is larger than this server's limit of {self.max_bytes} bytes")
            return await response(scope, receive, send)
        except TimeoutError:
            response = error_response(408, "RequestTimeoutError",
                                      f"the request body did not arrive within {self.timeout_s:g} s")
            return await response(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # what follows is the disconnect a stream listens for
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class _TooLarge(Exception):
    pass


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; each request's headers must arrive within `read_timeout_s` of
    its first byte (of the connection's opening, for the first request)."""

    def __init__(self, *args, read_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_timeout_s = read_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self._read_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
