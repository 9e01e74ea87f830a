"""The engine around the runner: scheduler, KV block manager, detokenizer and the `LLM` entry point."""

from jaxrunner.engine.engine import LLMEngine
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.engine.llm import LLM
from jaxrunner.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestOutput"]
