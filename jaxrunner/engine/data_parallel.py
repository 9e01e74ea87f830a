"""Data parallelism: one `LLMEngine` per replica, behind the engine's own interface.

`data_parallel_size` d makes d engines, replica r on devices [r * tp, (r + 1) * tp) (each with its
own scheduler, KV cache and compiled programs). A new request goes to the replica with the fewest
unfinished requests and stays there; `step()` steps every replica that has work, in turn. With
async scheduling a replica's step returns once its batch is queued on its devices, so the replicas'
devices run together while one thread drives them all.

Why an engine per replica rather than one scheduler over a mesh's data axis: the replicas then need
no common batch shape (no padding to the fullest replica), no step in lockstep, and no change to the
runner; what they share is the host thread. vLLM's data parallelism is also an engine per rank.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from jaxrunner.engine.engine import LLMEngine
from jaxrunner.engine.processor import ProcessedPrompt, Processor, Prompt
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.engine.outputs import EngineStats, RequestOutput
from jaxrunner.engine.scheduler import SpecDecodingStats
from jaxrunner.lora_request import LoRARequest
from jaxrunner.sampling_params import SamplingParams


def make_engine(args: EngineArgs, defer_warm_up: bool = False) -> LLMEngine | DataParallelEngine:
    if args.data_parallel_size > 1:
        return DataParallelEngine(args, defer_warm_up)
    return LLMEngine(args, defer_warm_up)


class DataParallelEngine:
    def __init__(self, args: EngineArgs, defer_warm_up: bool = False) -> None:
        self.replicas = [LLMEngine(dataclasses.replace(args, data_parallel_rank=r), defer_warm_up)
                         for r in range(args.data_parallel_size)]
        first = self.replicas[0]
        self.args, self.config, self.model_config, self.tokenizer = args, first.config, first.model_config, first.tokenizer
        self.processor: Processor = first.processor
        self.sampling_defaults = first.sampling_defaults
        self._owner: dict[str, LLMEngine] = {}  # request id -> its replica, until its last output

    @property
    def startup(self) -> dict:
        return self.replicas[0].startup

    @property
    def warm(self) -> bool:
        return all(replica.warm for replica in self.replicas)

    def warm_up(self) -> None:
        for replica in self.replicas:
            replica.warm_up()

    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> ProcessedPrompt:
        return self.replicas[0].process_prompt(prompt, params)

    def add_request(self, request_id: str, prompt: Prompt | ProcessedPrompt, params: SamplingParams | None = None, *,
                    delta: bool = False, lora_request: LoRARequest | None = None) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = min(self.replicas, key=LLMEngine.num_unfinished_requests)
        replica.add_request(request_id, prompt, params, delta=delta, lora_request=lora_request)
        self._owner[request_id] = replica

    def abort_request(self, request_ids: Iterable[str], final_output: bool = True) -> None:
        for request_id in list(request_ids):
            replica = self._owner.get(request_id)
            if replica is not None:
                replica.abort_request([request_id], final_output)
                if not final_output:
                    del self._owner[request_id]

    def step(self) -> list[RequestOutput]:
        outputs = []
        for replica in self.replicas:
            if replica.has_unfinished_requests():
                outputs += replica.step()
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def drain(self) -> None:
        for replica in self.replicas:
            replica.drain()

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def stats(self) -> EngineStats:
        """The replicas' counters summed (KV usage: their mean)."""
        each = [e.stats() for e in self.replicas]
        total = {f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(EngineStats)
                 if f.name not in ("kv_cache_usage", "spec_decoding")}
        spec = SpecDecodingStats()
        for replica in self.replicas:
            for f in dataclasses.fields(SpecDecodingStats):
                mine, theirs = getattr(spec, f.name), getattr(replica.scheduler.spec_stats, f.name)
                setattr(spec, f.name, [a + b for a, b in itertools.zip_longest(mine, theirs, fillvalue=0)]
                        if isinstance(mine, list) else mine + theirs)
        return EngineStats(**total, kv_cache_usage=sum(s.kv_cache_usage for s in each) / len(each),
                           spec_decoding=spec.as_dict() if self.config.speculative.enabled else {})
