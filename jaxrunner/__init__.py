"""jaxrunner: a vLLM-style model runner in JAX/XLA, and the thin engine around it."""

import os

# jaxrunner uses transformers for configs and tokenizers only, never its PyTorch models: its
# advisory that PyTorch is missing (transformers >= 5.24 prints it on import) says nothing to our users.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.engine import LLM, CompletionOutput, EngineArgs, LLMEngine, RequestOutput
from jaxrunner.lora_request import LoRARequest
from jaxrunner.runner import Runner
from jaxrunner.sampling_params import SamplingParams, StructuredOutputsParams
from jaxrunner.step_io import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput

__all__ = [
    "LLM",
    "CachedRequestData",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "ModelConfig",
    "NewRequestData",
    "Runner",
    "RunnerConfig",
    "RunnerOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "SchedulerOutput",
]
