"""`LLM`: vLLM's offline entry point, for people who just want text.

    llm = LLM(model="path/to/hf-checkpoint", max_model_len=1024)
    for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32)):
        print(out.outputs[0].text)

`LLM()` with no model uses the built-in tiny random model (see `default_model`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from jaxrunner.engine.engine import LLMEngine, Prompt
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.sampling_params import SamplingParams


class LLM:
    """`engine_args` keep vLLM's names: dtype, max_model_len, block_size, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, gpu_memory_utilization, num_gpu_blocks_override,
    seed, tokenizer, skip_tokenizer_init, max_logprobs, logprobs_mode (see `EngineArgs`)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Finished outputs, in the order of `prompts`. A prompt that cannot run gets an output with
        finish_reason "error" (and `error` set) while the others complete."""
        request_ids = self._add_requests(prompts, sampling_params, delta=False)
        own_ids = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        num_in = num_out = 0
        try:
            while len(finished) < len(request_ids):
                for out in self.llm_engine.step():
                    if not out.finished or out.request_id not in own_ids:
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
            self.llm_engine.abort_request([rid for rid in request_ids if rid not in finished])
        return [finished[rid] for rid in request_ids]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Outputs as tokens arrive: each carries only the new text and token ids of the completions
        that progressed (vLLM's DELTA outputs); the last one of a request has `finished` set.
        Closing the iterator early aborts what is still running."""
        request_ids = self._add_requests(prompts, sampling_params, delta=True)
        pending = set(request_ids)
        try:
            while pending:
                for out in self.llm_engine.step():
                    if out.request_id not in pending:
                        continue
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            self.llm_engine.abort_request(sorted(pending))

    def _add_requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        delta: bool,
    ) -> list[str]:
        """Check every prompt first, so a bad sampling parameter raises before anything is queued."""
        prompt_list = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompt_list):
            raise ValueError(
                f"got {len(params)} sampling_params for {len(prompt_list)} prompts: pass one SamplingParams, "
                "or a list with one per prompt"
            )
        processed = [self.llm_engine.process_prompt(p, sp) for p, sp in zip(prompt_list, params)]
        request_ids = [str(next(self._ids)) for _ in processed]
        for request_id, inputs in zip(request_ids, processed):
            self.llm_engine.add_request(request_id, inputs, delta=delta)
        return request_ids


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, a dict, a flat list of token ids) or a sequence of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts
