"""`jaxrunner serve` as exposed to hostile or careless clients (one server of the tiny random model,
with an API key, a small body limit and a short read timeout): a request that breaks the tokenizer
or its template fails alone with a 400, a slow template stalls no stream, a bug met while serving
one request is that request's 500, limits and timeouts hold, and random bodies (hypothesis) never get
a 5xx nor change a canary stream's tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from jaxrunner import EngineArgs, LLMEngine
from jaxrunner.engine.default_model import TINY_MODEL
from jaxrunner.server.api_server import build_app
from jaxrunner.server.async_llm import AsyncLLM
from jaxrunner.server.metrics import ServerMetrics
from jaxrunner.server.guards import LastResort
from jaxrunner.server.protocol import MAX_N, MAX_PROMPTS, MAX_STOP
from test_server import start_server, stop_server

KEY = "test-key"
BODY_LIMIT = 100_000
READ_TIMEOUT_S = 2
CANARY = {"prompt": "The canary sings", "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
SLOW_TEMPLATE = ("{% set ns = namespace(x=0) %}{% for i in range(100000) %}{% for j in range(4) %}{% set ns.x = ns.x + j %}"
                 "{% endfor %}{% endfor %}" + TEMPLATE)  # seconds of rendering


@pytest.fixture(scope="module")
def server():
    proc, url = start_server(TINY_MODEL, "--max-model-len", "128", "--max-num-seqs", "16", "--api-key", KEY,
                             "--max-request-body-bytes", str(BODY_LIMIT), "--read-timeout", str(READ_TIMEOUT_S),
                             "--trust-request-chat-template")
    yield url
    log = stop_server(proc)
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]


def request(url: str, body: bytes | dict | None = None, key: str | None = KEY, timeout: float = 120,
            headers: dict | None = None) -> tuple[int, bytes]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def message(reply: bytes) -> str:
    return json.loads(reply)["error"]["message"]


def healthy(url: str) -> bool:
    return request(f"{url}/health", key=None)[0] == 200


def canary_text(url: str) -> str:
    """The canary's text, streamed (so it is stepped beside whatever else the server runs)."""
    status, reply = request(f"{url}/v1/completions", {**CANARY, "stream": True})
    assert status == 200, reply
    events = [json.loads(line[6:]) for line in reply.decode().splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


class Canary:
    """The canary streamed over and over on a thread of its own while a test runs."""

    def __init__(self, url: str, expected: str) -> None:
        self.url, self.expected, self.texts, self._stop = url, expected, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.texts.append(canary_text(self.url))
        while not self._stop.is_set():
            self.texts.append(canary_text(self.url))

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=300)
        assert self.texts and all(text == self.expected for text in self.texts), self.texts


@pytest.fixture(scope="module")
def canary(server) -> str:
    return canary_text(server)


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("route, body, words", [
    ("completions", {"prompt": "a\ud800b"}, "prompt: the text is not valid Unicode"),
    ("completions", {"prompt": ["fine", "a\udfffb"]}, "not valid Unicode"),
    ("completions", {"prompt": "Hi", "bad_words": ["a\ud800"]}, "bad_words is not valid Unicode"),
    ("completions", {"prompt": "Hi", "stop": "\ud800"}, "stop is not valid Unicode"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x\ud800"}], "chat_template": TEMPLATE},
     "content is not valid Unicode"),
    ("chat/completions", {"messages": CHAT, "chat_template": "{% for %}"}, "TemplateSyntaxError"),
    ("chat/completions", {"messages": CHAT, "chat_template": '{% include "/etc/passwd" %}'}, "does not render"),
    ("chat/completions", {"messages": CHAT, "chat_template": "{{ 1 / 0 }}"}, "ZeroDivisionError"),
    ("chat/completions", {"messages": CHAT}, "no chat template"),
    ("completions", {"prompt": "Hi", "n": MAX_N + 1}, f"less than or equal to {MAX_N}"),
    ("completions", {"prompt": ["Hi"] * (MAX_PROMPTS + 1)}, f"the {MAX_PROMPTS} one request may give"),
    ("completions", {"prompt": "Hi", "stop": ["x"] * (MAX_STOP + 1)}, f"at most {MAX_STOP} items"),
])
def test_a_request_that_breaks_tokenizer_or_template_fails_alone(server, canary, route, body, words):
    """Each of these ended the engine's thread before: no reply, every stream a 503, /health 503."""
    with Canary(server, canary):
        status, reply = request(f"{server}/v1/{route}", {"max_tokens": 4, **body})
    assert status == 400 and words in message(reply), reply
    assert healthy(server)


def test_a_slow_template_delays_its_own_request_and_no_stream(server, canary):
    """The template renders on a worker thread: the canary's streams finish while it still renders."""
    done = threading.Event()
    result = []

    def slow() -> None:
        result.append(request(f"{server}/v1/chat/completions",
                              {"messages": CHAT, "chat_template": SLOW_TEMPLATE, "max_tokens": 2}))
        done.set()

    thread = threading.Thread(target=slow)
    thread.start()
    with Canary(server, canary) as c:
        while len(c.texts) < 3 and not done.is_set():
            time.sleep(0.05)
        streams_while_rendering = len(c.texts) if not done.is_set() else 0
    thread.join(timeout=300)
    assert streams_while_rendering >= 3
    assert result[0][0] == 200 and json.loads(result[0][1])["choices"][0]["finish_reason"] == "length"


def test_the_api_key_guards_v1_and_leaves_health_and_metrics_open(server):
    for key in (None, "wrong", KEY[:-1]):
        status, reply = request(f"{server}/v1/models", key=key)
        assert status == 401 and "Authorization: Bearer" in message(reply)
        assert request(f"{server}/v1/completions", {"prompt": "Hi"}, key=key)[0] == 401
    assert request(f"{server}/v1/models")[0] == 200
    assert request(f"{server}/metrics", key=None)[0] == 200 and healthy(server)


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from jaxrunner.cli import build_parser

    monkeypatch.setenv("JAXRUNNER_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("JAXRUNNER_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


def test_a_body_over_the_limit_is_a_413_declared_or_chunked(server):
    big = json.dumps({"prompt": "word " * BODY_LIMIT}).encode()
    status, reply = request(f"{server}/v1/completions", big)
    assert status == 413 and str(BODY_LIMIT) in message(reply)
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:  # no Content-Length: chunks
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            s.sendall(b"%x\r\n" % 60_000 + b" " * 60_000 + b"\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 413")
    assert request(f"{server}/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


def test_connections_whose_headers_or_body_do_not_arrive_are_closed(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10 * READ_TIMEOUT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and the rest of the headers never come
        assert s.recv(1024) == b""  # closed by the server
    with socket.create_connection((host, int(port)), timeout=10 * READ_TIMEOUT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        assert s.recv(1024).startswith(b"HTTP/1.1 408")
    assert healthy(server)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(st.characters(exclude_categories=())),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=8)
UNICODE = st.text(st.characters(exclude_categories=()), max_size=40) | st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e"])
FIELDS = {
    "prompt": UNICODE | st.lists(UNICODE, max_size=3) | st.lists(st.integers(-5, 1000), max_size=8) | JSON,
    "max_tokens": st.integers(-2, 40) | JSON, "n": st.integers(-1, 4) | JSON,
    "temperature": st.floats() | JSON, "top_p": st.floats(), "top_k": st.integers(-3, 10 ** 12), "min_p": st.floats(),
    "seed": st.integers(-2 ** 70, 2 ** 70), "stop": UNICODE | st.lists(UNICODE, max_size=3),
    "logprobs": st.integers(-2, 30) | st.booleans(), "top_logprobs": st.integers(-2, 30),
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(), max_size=3),
    "presence_penalty": st.floats(), "frequency_penalty": st.floats(), "repetition_penalty": st.floats(),
    "bad_words": st.lists(UNICODE, max_size=2), "allowed_token_ids": st.lists(st.integers(-2, 1000), max_size=3),
    "stream": st.booleans(), "echo": st.booleans(), "ignore_eos": st.booleans(), "min_tokens": st.integers(-2, 50),
    "structured_outputs": st.fixed_dictionaries({}, optional={"regex": UNICODE, "choice": st.lists(UNICODE, max_size=3),
                                                              "json": JSON, "grammar": UNICODE}),
    "response_format": JSON, "stream_options": JSON, "model": UNICODE,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | UNICODE,
                                                "content": UNICODE | JSON}), max_size=3) | JSON,
    "chat_template": UNICODE,
}
TEXT = st.text(max_size=30)
SOME_FIELDS = st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: FIELDS[name] for name in names}))
COMPLETION = st.fixed_dictionaries({"prompt": TEXT, "max_tokens": st.integers(1, 8)})
CHAT_BODY = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}),
                                                        min_size=1, max_size=2),
                                   "chat_template": st.just(TEMPLATE), "max_tokens": st.integers(1, 8)})
REQUESTS = (  # (route, body): mostly well-formed with a random field or two, then anything at all
    st.tuples(st.just("completions"), st.tuples(COMPLETION, SOME_FIELDS).map(lambda t: {**t[0], **t[1]}))
    | st.tuples(st.just("chat/completions"), st.tuples(CHAT_BODY, SOME_FIELDS).map(lambda t: {**t[0], **t[1]}))
    | st.tuples(st.sampled_from(["completions", "chat/completions", "models", "nowhere"]),
                st.fixed_dictionaries({}, optional=FIELDS) | JSON | st.binary(max_size=64)))


def test_random_bodies_get_2xx_or_4xx_and_leave_a_canary_stream_unchanged(server, canary):
    answered = {}

    @settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(REQUESTS)
    def fuzz(route_and_body: tuple[str, dict | bytes]) -> None:
        route, body = route_and_body
        status, reply = request(f"{server}/v1/{route}", body if isinstance(body, bytes) else json.dumps(body).encode())
        assert 200 <= status < 500, (status, body, reply)
        answered[status] = answered.get(status, 0) + 1

    with Canary(server, canary):
        fuzz()
    assert healthy(server)
    assert answered.get(200, 0) > 0 and answered.get(400, 0) > 0, answered


def test_a_bug_met_while_taking_one_request_is_its_500_and_the_engine_steps_on(caplog):
    """A fault inside the engine (here an injected one) reaches that request's caller alone."""
    from jaxrunner import LLM, SamplingParams

    with LLM(TINY_MODEL, max_model_len=64, max_num_seqs=4, enforce_eager=True) as llm:
        engine = llm.llm_engine
        add_request = engine.add_request

        def faulty(request_id, inputs, *args, **kwargs):
            if inputs.prompt == "boom":
                raise RuntimeError("an injected fault")
            return add_request(request_id, inputs, *args, **kwargs)

        engine.add_request = faulty
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        expected = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].text

        async def main() -> tuple[BaseException, str]:
            async_llm = AsyncLLM(engine)
            async_llm.start()
            with pytest.raises(RuntimeError, match="injected") as fault:
                await async_llm.add_request("a", "boom", params)
            stream = await async_llm.add_request("b", "Hello", params)
            text = "".join([c.text async for out in stream for c in out.outputs])
            assert async_llm.is_running
            await async_llm.close()
            return fault.value, text

        fault, text = asyncio.run(main())
    assert text == expected

    async def route(scope, receive, send):
        raise fault

    sent = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    with caplog.at_level(logging.ERROR, logger="jaxrunner.server"):
        asyncio.run(LastResort(route)({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                                      receive, send))
    assert sent[0]["status"] == 500
    reply = json.loads(sent[1]["body"])["error"]["message"]
    error_id = reply.split()[2]
    assert "internal error" in reply and "injected" not in reply
    (record,) = caplog.records
    assert error_id in record.getMessage() and "injected fault" in caplog.text  # the traceback, under the id


def test_health_says_starting_until_the_programs_are_ready(monkeypatch):
    """A server's engine compiles once the port is open: /health answers 503 "starting" meanwhile,
    a request sent then waits, and both go through once warm-up is done. One request, one slot: warm-up
    compiles a single request bucket."""
    engine = LLMEngine(EngineArgs(TINY_MODEL, max_model_len=32, max_num_seqs=1, max_num_batched_tokens=16,
                                  enforce_eager=False), defer_warm_up=True)
    assert not engine.warm and engine.startup == {}
    release, warmup = threading.Event(), engine.runner.warmup
    monkeypatch.setattr(engine.runner, "warmup", lambda *args, **kwargs: release.wait(120) and warmup(*args, **kwargs))
    app = build_app(AsyncLLM(engine), ServerMetrics("tiny"), "tiny")
    with TestClient(app) as client:
        starting = client.get("/health")
        assert starting.status_code == 503 and "starting" in starting.json()["error"]["message"]
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(client.post, "/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            time.sleep(0.5)
            assert not reply.done()  # it waits for the programs
            release.set()
            assert reply.result(timeout=300).status_code == 200
        assert client.get("/health").status_code == 200
    assert engine.warm and engine.startup["programs"] > 0
