"""jaxrunner: a vLLM-style model runner in JAX/XLA, and the thin engine around it."""

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.runner import Runner
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.step_io import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput

__all__ = [
    "CachedRequestData",
    "ModelConfig",
    "NewRequestData",
    "Runner",
    "RunnerConfig",
    "RunnerOutput",
    "SamplingParams",
    "SchedulerOutput",
]
