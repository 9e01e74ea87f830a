"""`LLM`: vLLM's offline entry point, for people who just want text.

    llm = LLM(model="path/to/hf-checkpoint", max_model_len=1024)
    for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32)):
        print(out.outputs[0].text)

`LLM()` with no model uses the built-in default model (see `model_files`); `chat` applies the
tokenizer's chat template first. Without sampling params a call takes the model's sampling defaults
(`get_default_sampling_params`), as vLLM does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from jaxrunner.checks import all_ints
from jaxrunner.engine.chat import Conversation, render_chat
from jaxrunner.engine.data_parallel import make_engine
from jaxrunner.engine.processor import Prompt
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.lora_request import LoRARequest
from jaxrunner.sampling_params import SamplingParams


class LLM:
    """`engine_args` keep vLLM's names: dtype, max_model_len, block_size, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, gpu_memory_utilization, num_gpu_blocks_override,
    seed, tokenizer, skip_tokenizer_init, max_logprobs, logprobs_mode, generation_config (see `EngineArgs`).

    `close()` (or a `with` block) waits for the device and frees the engine; an LLM left open is
    closed at interpreter exit."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = make_engine(EngineArgs.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()
        # Outputs by request id, for the requests a generate or generate_stream call is consuming:
        # each call takes its own, so calls interleaved from one thread never lose each other's.
        self._outbox: dict[str, list[RequestOutput]] = {}

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.llm_engine.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params uses: the model's defaults (its generation_config.json,
        see `EngineArgs.generation_config`) over SamplingParams' own."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Finished outputs, in the order of `prompts`. A prompt that cannot run gets an output with
        finish_reason "error" (and `error` set) while the others complete. `lora_request`: one
        adapter for every prompt, or one (or None) per prompt. Returns once nothing it dispatched is
        still running on the device."""
        request_ids = self._add_requests(prompts, sampling_params, delta=False, lora_request=lora_request)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        num_in = num_out = 0
        try:
            while len(finished) < len(request_ids):
                for out in self._next_outputs(request_ids):
                    if not out.finished:
                        continue
                    finished[out.request_id] = out
                    num_in += len(out.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"est. speed input: {num_in / elapsed:.2f} toks/s, output: {num_out / elapsed:.2f} toks/s"
                    )
                    bar.update(1)
        finally:
            bar.close()
            self._release(request_ids)
        return [finished[rid] for rid in request_ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's chat: each conversation ([{"role": "user", "content": "Hi"}, ...], or a list of them)
        rendered with the tokenizer's chat template (or `chat_template`), then generated."""
        prompts = self.render_chat(messages, chat_template, add_generation_prompt, continue_final_message)
        return self.generate(prompts, sampling_params, use_tqdm)

    def render_chat(
        self,
        messages: Conversation | Sequence[Conversation],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[dict]:
        """The prompts `chat` would generate from, for `generate_stream`."""
        return render_chat(self.get_tokenizer(), messages, chat_template, add_generation_prompt, continue_final_message)

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Outputs as tokens arrive: each carries only the new text and token ids of the completions
        that progressed (vLLM's DELTA outputs); the last one of a request has `finished` set (an
        aborted request's with finish_reason "abort"). Closing the iterator early aborts what is
        still running."""
        request_ids = self._add_requests(prompts, sampling_params, delta=True, lora_request=lora_request)
        pending = set(request_ids)
        try:
            while pending:
                for out in self._next_outputs(sorted(pending)):
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            self._release(request_ids)

    def _next_outputs(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """These requests' outputs that are waiting, or else those of one more engine step."""
        if not any(self._outbox[rid] for rid in request_ids):
            if not self.llm_engine.has_unfinished_requests():
                raise RuntimeError(f"the engine has nothing left to run, yet requests {list(request_ids)} never finished")
            for out in self.llm_engine.step():
                if out.request_id in self._outbox:
                    self._outbox[out.request_id].append(out)
        taken = []
        for rid in request_ids:
            taken += self._outbox[rid]
            self._outbox[rid] = []
        return taken

    def _release(self, request_ids: list[str]) -> None:
        """A call is done with its requests: abort what still runs, wait for the device, drop their outputs."""
        self.llm_engine.abort_request(request_ids, final_output=False)
        self.llm_engine.drain()
        for rid in request_ids:
            del self._outbox[rid]

    def _add_requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        delta: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Check every prompt first, so a bad prompt or sampling parameter raises before anything is queued."""
        prompt_list = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, dict)):
            params = list(sampling_params)
        else:
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        if len(params) != len(prompt_list):
            raise ValueError(
                f"got {len(params)} sampling_params for {len(prompt_list)} prompts: pass one SamplingParams, "
                "or a list with one per prompt"
            )
        loras = _per_prompt("lora_request", lora_request, len(prompt_list), LoRARequest)
        if any(loras) and not self.llm_engine.config.lora.enabled:
            raise ValueError("lora_request needs LoRA on: pass enable_lora=True")
        processed = [self.llm_engine.process_prompt(p, sp) for p, sp in zip(prompt_list, params)]
        request_ids = [str(next(self._ids)) for _ in processed]
        for request_id, inputs, lora in zip(request_ids, processed, loras):
            self.llm_engine.add_request(request_id, inputs, delta=delta, lora_request=lora)
            self._outbox[request_id] = []
        return request_ids


def _per_prompt(name: str, value, n: int, kind: type) -> list:
    """One value for every prompt, or a list with one (or None) per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if isinstance(value, Sequence) and not isinstance(value, (str, dict)):
        values = list(value)
        if len(values) != n or not all(v is None or isinstance(v, kind) for v in values):
            raise ValueError(f"{name}: give one {kind.__name__}, or a list with one (or None) for each of the {n} prompts")
        return values
    raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {type(value).__name__}")


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, a dict, a flat list of token ids) or a sequence of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all_ints(prompts):
        return [prompts]
    return prompts
