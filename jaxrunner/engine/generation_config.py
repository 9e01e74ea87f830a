"""Sampling defaults from the model, as vLLM's `generation_config` ("auto", "vllm" or a directory).

A checkpoint's generation_config.json holds its maker's sampling settings. With "auto" those fields
(below) become the defaults of every request that leaves them out: `LLM.generate` and `chat`
without sampling params (`LLM.get_default_sampling_params`), the CLI's sampling flags left out, and
the server's body fields left out; a request's own values always win. "vllm" takes none
(SamplingParams' own defaults); a directory takes the generation_config.json in it, for any model.

The built-in model ships as a GGUF file, without a generation_config.json, and SmolLM2-135M is too
small to sample well at SamplingParams' temperature 1.0: "auto" gives it BUILT_IN_DEFAULTS, chosen
on 20 plain questions (benchmarks/default_sampling.py, docs/default_sampling.md). Other GGUF files,
and checkpoints without the file, keep SamplingParams' defaults unless a directory is given.

As in vLLM, `do_sample` is not read: a generation_config.json that names a temperature means it.
"""

from __future__ import annotations

import json
import logging
import os

from jaxrunner.engine.model_files import DEFAULT_MODEL
from jaxrunner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
MODES = ("auto", "vllm")
# generation_config.json's names -> SamplingParams'
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
BUILT_IN_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.05}


def check_generation_config(value: str) -> None:
    """ValueError unless `value` is "auto", "vllm" or a directory."""
    if not (isinstance(value, str) and (value in MODES or os.path.isdir(value))):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding {GENERATION_CONFIG}, "
                         f"got {value!r}")


def sampling_defaults(generation_config: str, model: str | None, built_in: bool) -> dict:
    """The SamplingParams fields a request leaves out take, for the model whose files are in the
    directory `model` (None, or a name that is no directory: it has none); `built_in`: it is the
    built-in model. Logs the defaults taken, if any."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        if built_in:
            return _taken(dict(BUILT_IN_DEFAULTS), f"jaxrunner's choice for the built-in {DEFAULT_MODEL}")
        if model is None or not os.path.isfile(path := os.path.join(model, GENERATION_CONFIG)):
            return {}
    else:
        path = os.path.join(generation_config, GENERATION_CONFIG)
        if not os.path.isfile(path):
            raise ValueError(f"generation_config: {generation_config!r} holds no {GENERATION_CONFIG}; give a directory "
                             "that does, or 'auto' or 'vllm'")
    return _taken(read_generation_config(path), path)


def read_generation_config(path: str) -> dict:
    """The sampling defaults a generation_config.json sets, checked as SamplingParams checks them."""
    try:
        with open(path) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"it holds {type(config).__name__}, not a JSON object")
        defaults = {FIELDS[name]: value for name, value in config.items() if name in FIELDS and value is not None}
        SamplingParams(**defaults)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"{path} is not a usable generation config ({reason}); fix it, or pass "
                         "generation_config='vllm' (--generation-config vllm) to ignore it") from None
    return defaults


def _taken(defaults: dict, source: str) -> dict:
    if defaults:
        settings = ", ".join(f"{name}={value}" for name, value in defaults.items())
        logger.warning("sampling defaults from %s: %s (a request's own values win; generation_config='vllm' "
                       "ignores them)", source, settings)
    return defaults
