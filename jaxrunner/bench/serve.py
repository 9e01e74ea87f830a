"""`jaxrunner bench serve`: a load generator against a running `jaxrunner serve` (or any OpenAI-
compatible server). W2's requests (prompts of random token ids, lengths uniform in [min, max],
`new` greedy tokens each with EOS ignored) arrive as a Poisson process at `request_rate` per second
(inf: all at once) and stream their tokens back as server-sent events.

The client is aiohttp with request bodies encoded before the clock starts: the official `openai`
client spends milliseconds of Python per request on its parameter transforms and a pydantic model
per chunk, and at hundreds of streams from one process that, not the server, set the pace.

Figures: output tokens per second from the first request sent to the last token received; time to
first token; inter-token latency as the gap between streamed chunks (a server that runs several
decode steps per device call sends several tokens a chunk); time per output token after the first.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np
from tqdm import tqdm

WARMUP_REQUESTS = 4
PROMPT_TOKEN_IDS = 64  # ids drawn below this: inside every model's vocabulary (the tiny random model has 99)


def run(
    base_url: str = "http://127.0.0.1:8000",
    model: str | None = None,
    num_prompts: int = 256,
    request_rate: float = math.inf,
    min_prompt: int = 100,
    max_prompt: int = 1024,
    new: int = 512,
    seed: int = 0,
) -> dict:
    if num_prompts < 1 or new < 1 or not 1 <= min_prompt <= max_prompt or not request_rate > 0:
        raise ValueError(f"need num_prompts >= 1, new >= 1, 1 <= min_prompt <= max_prompt and request_rate > 0; got "
                         f"num_prompts={num_prompts}, new={new}, min_prompt={min_prompt}, max_prompt={max_prompt}, "
                         f"request_rate={request_rate}")
    args = dict(base_url=base_url, num_prompts=num_prompts, request_rate=request_rate, min_prompt=min_prompt,
                max_prompt=max_prompt, new=new, seed=seed)
    return asyncio.run(_run(args, model))


async def _run(args: dict, model: str | None) -> dict:
    import aiohttp

    rng = np.random.default_rng(args["seed"])
    lengths = rng.integers(args["min_prompt"], args["max_prompt"] + 1, args["num_prompts"])
    prompts = [rng.integers(0, PROMPT_TOKEN_IDS, n).tolist() for n in lengths]
    warmup = [rng.integers(0, PROMPT_TOKEN_IDS, args["min_prompt"]).tolist() for _ in range(WARMUP_REQUESTS)]
    gaps = rng.exponential(1 / args["request_rate"], len(prompts)) if math.isfinite(args["request_rate"]) else np.zeros(len(prompts))
    url = f"{args['base_url']}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # no cap on open connections: every stream at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        try:
            async with session.get(f"{args['base_url']}/v1/models") as r:
                model = model or (await r.json())["data"][0]["id"]
        except aiohttp.ClientConnectionError:
            raise ValueError(f"no server answers at {args['base_url']}: start one with `jaxrunner serve`") from None

        def body(prompt: list[int]) -> bytes:
            return json.dumps({"model": model, "prompt": prompt, "max_tokens": args["new"], "temperature": 0.0,
                               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()

        await asyncio.gather(*(_request(session, url, body(p), 0.0, None) for p in warmup))
        bodies = [body(p) for p in prompts]
        bar = tqdm(total=len(prompts), desc="Requests", dynamic_ncols=True)
        start = time.perf_counter()
        results = await asyncio.gather(*(_request(session, url, b, delay, bar) for b, delay in zip(bodies, np.cumsum(gaps))))
        elapsed = time.perf_counter() - start
        bar.close()
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["chunks"][0] - r["sent"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {
        "workload": "serve", "model": model, "args": args, "elapsed_s": elapsed, "prompt_tokens": int(lengths.sum()),
        "output_tokens": tokens, "tokens_per_s": tokens / elapsed, "requests_per_s": len(results) / elapsed,
        **{f"{name}_ms": _percentiles(values) for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot))},
    }


async def _request(session, url: str, body: bytes, delay: float, bar) -> dict:
    await asyncio.sleep(delay)
    sent, chunks, tokens = time.perf_counter(), [], 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server failed a stream: {event['error']['message']}")
            if event["choices"]:
                chunks.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if bar is not None:
        bar.update(1)
    return {"sent": sent, "chunks": chunks, "tokens": tokens}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def summary(result: dict) -> str:
    a = result["args"]
    lines = [f"serve: {result['model']} at {a['base_url']}, {a['num_prompts']} requests at rate {a['request_rate']}/s, "
             f"prompts of {a['min_prompt']}-{a['max_prompt']} tokens, {a['new']} new tokens each",
             f"  {result['tokens_per_s']:.0f} output tokens/s ({result['output_tokens']} in {result['elapsed_s']:.2f} s), "
             f"{result['requests_per_s']:.2f} requests/s"]
    for name, label in (("ttft", "time to first token"), ("itl", "inter-chunk latency"), ("tpot", "time per output token")):
        p = result[f"{name}_ms"]
        if p:
            lines.append(f"  {label}: mean {p['mean']:.1f} ms, p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms")
    return "\n".join(lines)
