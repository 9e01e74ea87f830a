"""Engine arguments, with vLLM's names, and how they become the runner's and scheduler's sizes.

Defaults depend on the platform: on a GPU they follow vLLM (256 sequences, 8192 tokens per step,
the checkpoint's dtype, the KV cache sized from the memory left by the weights and the largest
step); on a CPU they are small (8 sequences, 256 tokens per step, float32), because every bucket
is compiled and CPU compilation is slow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from jaxrunner import platform
from jaxrunner.checks import check_bool, check_int, is_real
from jaxrunner.config import LoraConfig, ModelConfig, RunnerConfig, SamplerConfig, SpeculativeConfig, check_quantization
from jaxrunner.engine.block_manager import blocks_to_hold, null_blocks
from jaxrunner.engine.default_model import default_model, default_model_config
from jaxrunner.engine.generation_config import check_generation_config
from jaxrunner.engine.host_tier import in_flight_bytes, max_loads
from jaxrunner.engine.model_files import cache_dir, local_model
from jaxrunner.engine.scheduler import SchedulerConfig
from jaxrunner.checkpoints.dummy import Params, dummy_config, random_params
from jaxrunner.checkpoints.loader import Checkpoint, held_as, held_config, open_checkpoint
from jaxrunner.runner import (
    Programs,
    bytes_per_block,
    largest_step_bytes,
    load_programs,
    lora_bytes,
    program_cache_of,
    runner_context,
    stored_step_bytes,
)

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
CPU_KV_CACHE_BYTES = 2**30
KV_BLOCKS_JITTER = 1024  # starts of one sizing differ in the blocks that fit by far less than 1/1024 of them


@dataclass(frozen=True)
class EngineArgs:
    """`model`: a Hugging Face checkpoint directory, a GGUF file (or a directory holding one), a Hub
    id "org/name", "jaxrunner-tiny-random", or None for the default model (see `model_files`).
    `tokenizer`: defaults to `model`'s. `skip_tokenizer_init`: no tokenizer; prompts must be token
    ids and outputs have empty text. `gpu_memory_utilization`: the fraction of JAX's GPU memory
    pool the weights, the largest step and the KV cache may use (ignored on CPU); the engine sets
    the pool to 95% of the device (`platform.claim_gpu_memory`) unless XLA_CLIENT_MEM_FRACTION is
    set or JAX's backend already started. `num_gpu_blocks_override` fixes the number of KV blocks
    instead. `max_logprobs`: the most logprobs a request may ask for (-1: the whole
    vocabulary); `logprobs_mode`: raw_logprobs, raw_logits, processed_logprobs or processed_logits.
    `enforce_eager`: skip compiling every bucket at start-up (they then compile when first used);
    by default start-up compiles them on a GPU and skips it on a CPU; either way compiled programs
    are kept in JAX's persistent cache under `model_files.cache_dir()`. `compile_in_background`:
    start-up compiles only the largest buckets, a thread the others, steps padding up to the
    buckets ready meanwhile (`Runner.warmup`). `batch_invariant`: a request's tokens and logprobs
    do not depend on the batch it runs in (`config.RunnerConfig`). `load_format` "dummy": random
    weights in the model's shape, where `model` is a checkpoint directory (only its config.json is
    read) or a benchmark shape name (`jaxrunner.checkpoints.dummy.SHAPES`). `num_scheduler_steps`: decode
    steps per device call when a batch is all decodes (multi-step decode). `async_scheduling`:
    dispatch each step before the previous step's output reaches the host. `max_bad_word_len`: the
    most tokens a bad word may have (the sampler's bad-word arrays are this wide). `kernels`: "auto" (Pallas on a GPU, the jnp
    references elsewhere), "pallas" (interpreted off a GPU), "mosaic" ("pallas" with the Mosaic GPU
    kernels, `config.Kernels`) or "reference". `speculative_config`:
    vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}
    (`config.SpeculativeConfig`). `enable_lora`: serve LoRA adapters (`LoRARequest`), up to `max_loras`
    in one batch, of rank up to `max_lora_rank`; `max_cpu_loras` adapters stay parsed on the host
    (default `max_loras`). `tensor_parallel_size`: devices the model is split over (Megatron style,
    `jaxrunner.runner.parallel`); `data_parallel_size`: replicas of it, each on devices of its own
    (`engine.data_parallel`; `data_parallel_rank` is the replica an engine is). `kv_cache_dtype`:
    "auto" (the model's dtype) or "fp8" (e4m3 pages, twice the blocks; `config.RunnerConfig`).
    `quantization`: how the layers' linear weights are held, None (the dtype), "fp8" (W8A8), "int8"
    or "int4" (weight-only), quantized from the checkpoint as it loads (`models.quantization`).
    `generation_config`: where requests' sampling defaults come from, "auto" (the model's
    generation_config.json), "vllm" (SamplingParams' own) or a directory (`engine.generation_config`).
    `kv_offloading_size`: GiB of host memory for the prefix cache's second tier (vLLM's name; each
    data-parallel replica has its own): blocks
    evicted from the device are kept there, and a prefix found there is copied back instead of
    computed again (`engine.host_tier`); needs enable_prefix_caching."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_logprobs: int = SamplerConfig.max_logprobs
    logprobs_mode: str = SamplerConfig.logprobs_mode
    enforce_eager: bool | None = None
    compile_in_background: bool = False
    batch_invariant: bool = False
    load_format: str = "auto"
    num_scheduler_steps: int = 1
    async_scheduling: bool = True
    max_bad_word_len: int = SamplerConfig.max_bad_word_len
    kernels: str = "auto"
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    generation_config: str = "auto"
    kv_offloading_size: float | None = None

    def __post_init__(self) -> None:
        where = "EngineArgs"
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override"):
            check_int(where, name, getattr(self, name), 1, optional=True)
        for name in ("block_size", "num_scheduler_steps", "max_bad_word_len", "tensor_parallel_size",
                     "data_parallel_size"):
            check_int(where, name, getattr(self, name), 1)
        check_int(where, "seed", self.seed)
        check_int(where, "data_parallel_rank", self.data_parallel_rank, 0)
        check_int(where, "max_logprobs", self.max_logprobs)
        for name in ("skip_tokenizer_init", "enable_prefix_caching", "async_scheduling", "enable_lora"):
            check_bool(where, name, getattr(self, name))
        if self.enforce_eager is not None:
            check_bool(where, "enforce_eager", self.enforce_eager)
        check_bool(where, "compile_in_background", self.compile_in_background)
        check_bool(where, "batch_invariant", self.batch_invariant)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.load_format == "dummy" and self.model is None:
            raise ValueError("load_format='dummy' needs model: a checkpoint directory or a shape name")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_quantization(self.quantization)  # before anything loads
        if not (is_real(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check_generation_config(self.generation_config)
        if self.kv_offloading_size is not None:
            if not (is_real(self.kv_offloading_size) and self.kv_offloading_size > 0):
                raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {self.kv_offloading_size!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size keeps the prefix cache's evicted blocks in host memory, so it needs "
                                 "enable_prefix_caching=True")
        check_int(where, "max_loras", self.max_loras, 1)
        sizes = {} if self.max_num_seqs is None or self.max_num_batched_tokens is None else dict(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        self.create_runner_config(**sizes)  # RunnerConfig's rules (and its parts'), before anything loads

    def create_runner_config(self, **sizes: Any) -> RunnerConfig:
        """The runner's config from these arguments, with `sizes` (what the model and the device decide:
        num_blocks, max_model_len, dtype, ...) over RunnerConfig's defaults. The rules between fields
        are RunnerConfig's alone; `__post_init__` makes one with the defaults, so they fail at once."""
        return RunnerConfig(
            block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype, seed=self.seed,
            num_scheduler_steps=self.num_scheduler_steps, sampler=self.sampler_config(),
            speculative=self.speculative(), lora=self.lora_config(), tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size, data_parallel_rank=self.data_parallel_rank,
            kernels=self.kernels, batch_invariant=self.batch_invariant, **sizes,
        )

    def speculative(self) -> SpeculativeConfig:
        return SpeculativeConfig() if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    def lora_config(self) -> LoraConfig:
        return LoraConfig(self.max_loras if self.enable_lora else 0, self.max_lora_rank, self.max_cpu_loras)

    def sampler_config(self) -> SamplerConfig:
        return SamplerConfig(max_logprobs=self.max_logprobs, logprobs_mode=self.logprobs_mode,
                             max_bad_word_len=self.max_bad_word_len)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(kwargs) - names):
            raise TypeError(
                f"unsupported engine arguments: {', '.join(unknown)}; jaxrunner accepts {', '.join(sorted(names))}"
            )
        return cls(**kwargs)


def conversion_dtype(args: EngineArgs) -> str:
    """The dtype when no checkpoint names one: `dtype` as given, else float32 on CPU and bfloat16 on
    GPU. A GGUF checkpoint converts into it (`model_files.converted`)."""
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if platform.on_gpu() else "float32"


def resolve_dtype(args: EngineArgs) -> str:
    """dtype "auto" is float32 on CPU; on GPU the checkpoint's dtype (bfloat16 if it names none or float32)."""
    if args.dtype == "auto" and platform.on_gpu() and args.model is not None and os.path.isdir(args.model):
        with open(os.path.join(args.model, "config.json")) as f:
            hf = json.load(f)
        stored = hf.get("dtype") or hf.get("torch_dtype")
        if stored in ("bfloat16", "float16"):
            return stored
    return conversion_dtype(args)


def compilation_cache_dir() -> str:
    return os.path.join(cache_dir(), "xla")


def runner_config(args: EngineArgs, model: ModelConfig, dtype: str, draft: ModelConfig | None = None,
                  warming_up: bool = False) -> RunnerConfig:
    """`draft`: the draft model's config, where there is one. `warming_up`: the runner will compile
    every program next (see `_num_blocks`)."""
    sizes = _sizes(args, model, dtype)
    blocks = args.num_gpu_blocks_override or _num_blocks(args, model, sizes, draft, warming_up)
    return _with_blocks(args, model, sizes, draft, blocks)


def _config_ahead(args: EngineArgs, model: ModelConfig, dtype: str, draft: ModelConfig | None) -> RunnerConfig | None:
    """The configuration `runner_config` will most likely give, known before the weights load: where
    the KV cache's size does not depend on the memory they leave (a CPU, num_gpu_blocks_override),
    or as an earlier start of the same sizing took it (`blocks_as_before`); else None."""
    sizes = _sizes(args, model, dtype)
    blocks = args.num_gpu_blocks_override
    if not blocks:
        stats = platform.memory_stats(sizes.data_parallel_rank * sizes.tensor_parallel_size)
        if not stats:
            blocks = _num_blocks(args, model, sizes, draft)
        elif (activations := stored_step_bytes(runner_context(model, sizes, dtype, draft))) is not None:
            blocks = blocks_taken_before(sizes, _sizing(args, model, sizes, draft, stats["bytes_limit"], activations))
    return _with_blocks(args, model, sizes, draft, blocks) if blocks else None


def _sizes(args: EngineArgs, model: ModelConfig, dtype: str) -> RunnerConfig:
    """The runner's configuration with a KV cache of one block, for sizing it."""
    gpu = platform.on_gpu()
    max_model_len = args.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model.max_position_embeddings}; lower max_model_len"
        )
    # A step schedules a token per request at least: a default gives way to the size that was given.
    max_num_seqs, max_num_batched_tokens = (256, 8192) if gpu else (8, 256)
    if args.max_num_batched_tokens:
        max_num_batched_tokens = args.max_num_batched_tokens
        max_num_seqs = args.max_num_seqs or min(max_num_seqs, max_num_batched_tokens)
    else:
        max_num_seqs = args.max_num_seqs or max_num_seqs
        max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
    return args.create_runner_config(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_blocks=1,
        dtype=dtype,
        compilation_cache_dir=compilation_cache_dir(),
    )


def _with_blocks(args: EngineArgs, model: ModelConfig, sizes: RunnerConfig, draft: ModelConfig | None,
                 blocks: int) -> RunnerConfig:
    """`sizes` with a KV cache of `blocks` and the host tier's, checked to hold a sequence."""
    cfg = dataclasses.replace(sizes, num_blocks=blocks)
    cfg = dataclasses.replace(cfg, num_host_blocks=_num_host_blocks(args, model, cfg, draft))
    if (cfg.num_blocks - null_blocks(model.group_windows)) < (need := request_blocks(model, cfg, cfg.max_model_len)):
        raise ValueError(
            f"the KV cache ({cfg.num_blocks} blocks of {cfg.block_size} tokens) cannot hold one sequence of "
            f"max_model_len={cfg.max_model_len} tokens ({need} blocks over the model's KV-cache groups); raise "
            "num_gpu_blocks_override / gpu_memory_utilization or lower max_model_len"
        )
    return cfg


def _num_host_blocks(args: EngineArgs, model: ModelConfig, cfg: RunnerConfig, draft: ModelConfig | None) -> int:
    """The host tier's blocks in kv_offloading_size GiB (each data-parallel replica's own): whole
    blocks, every device's share of them."""
    if args.kv_offloading_size is None:
        return 0
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if args.kv_offloading_size * args.data_parallel_size * 2**30 > memory:
        replicas = f" times data_parallel_size={args.data_parallel_size}" if args.data_parallel_size > 1 else ""
        raise ValueError(f"kv_offloading_size={args.kv_offloading_size} GiB{replicas} is more than this machine's "
                         f"{memory / 2**30:.1f} GiB of memory; lower it")
    per_block = bytes_per_block(model, cfg, draft) * cfg.tensor_parallel_size
    num = int(args.kv_offloading_size * 2**30) // per_block
    if num < 1:
        raise ValueError(f"kv_offloading_size={args.kv_offloading_size} GiB holds no KV block of {per_block} bytes; "
                         "raise it")
    return num


def request_blocks(model: ModelConfig, cfg: RunnerConfig, num_tokens: int) -> int:
    """The most blocks one request of `num_tokens` tokens holds at once."""
    return blocks_to_hold(num_tokens, cfg.block_size, model.group_windows, cfg.max_num_batched_tokens,
                          cfg.speculative.num_speculative_tokens)


def scheduler_config(cfg: RunnerConfig, vocab_size: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        num_scheduler_steps=cfg.num_scheduler_steps,
        num_speculative_tokens=cfg.speculative.num_speculative_tokens,
        num_lookahead_tokens=cfg.speculative.num_lookahead_tokens,
        vocab_size=vocab_size,
        max_loras=cfg.lora.max_loras,
    )


def _num_blocks(args: EngineArgs, model: ModelConfig, cfg: RunnerConfig, draft: ModelConfig | None,
                warming_up: bool = False) -> int:
    """On GPU, as vLLM: the blocks that fit in `gpu_memory_utilization` of the device once the weights
    (already loaded) and the largest step's activations (`runner.largest_step_bytes`: measured from
    its compiled executables, made from the params' shapes) are set aside: 1/KV_BLOCKS_JITTER under
    that count, or as many as an earlier start took where they still fit (`blocks_as_before`).
    `warming_up`: the programs that hold no KV pages compile beside the sizing's own, for the
    runner's warm-up (`largest_step_bytes`); False where that would keep a start from serving
    sooner (a background warm-up, a server opening its port first). On
    CPU: enough for every sequence at full length, within CPU_KV_CACHE_BYTES (but always room for
    one sequence at full length)."""
    stats = platform.memory_stats(cfg.data_parallel_rank * cfg.tensor_parallel_size)  # its first
    per_block = bytes_per_block(model, cfg, draft)  # on each device
    if not stats:
        one = request_blocks(model, cfg, cfg.max_model_len)
        return null_blocks(model.group_windows) + max(one, min(cfg.max_num_seqs * one, CPU_KV_CACHE_BYTES // per_block))
    activations = largest_step_bytes(runner_context(model, cfg, cfg.dtype, draft), warming_up)
    sizing = _sizing(args, model, cfg, draft, stats["bytes_limit"], activations)
    *_, copies, adapters = sizing
    fit = kv_blocks_that_fit(stats["bytes_limit"], stats["bytes_in_use"] + adapters, activations + copies,
                             args.gpu_memory_utilization, per_block)
    blocks = blocks_as_before(cfg, sizing, fit)
    logger.info("KV cache sizing: %.2f GiB device, %.2f GiB in use (weights), %.2f GiB for the largest step's "
                "activations, %.2f GiB for the host tier's copies: %d blocks fit, %d taken", stats["bytes_limit"] / 2**30,
                stats["bytes_in_use"] / 2**30, activations / 2**30, copies / 2**30, fit, blocks)
    return blocks


def _sizing(args: EngineArgs, model: ModelConfig, cfg: RunnerConfig, draft: ModelConfig | None, limit: int,
            activations: int) -> tuple:
    """What sets the KV cache's size besides the bytes in use: the key of the blocks a start took.
    Ends with the device bytes the host tier's copies and the adapter slots (which come after
    sizing) take."""
    per_block = bytes_per_block(model, cfg, draft)
    return (model, cfg, limit, args.gpu_memory_utilization, per_block, activations, host_tier_bytes(args, cfg, per_block),
            lora_bytes(model, cfg))


def blocks_as_before(cfg: RunnerConfig, sizing: tuple, fit: int) -> int:
    """The KV blocks an earlier start with the same `sizing` took, where they still fit and leave at
    most 2/KV_BLOCKS_JITTER of `fit` unused; else 1/KV_BLOCKS_JITTER under `fit`, kept for the next
    start (whose room may be a little less, or a little more). The bytes in use after loading differ
    a little from one start to the next (a checkpoint just converted leaves other buffers than one
    restored), and the block count is in every program's shapes: taking the same count makes the
    same programs, so a later start finds them in the compilation caches."""
    cache = program_cache_of(cfg)
    if cache is None:
        return fit
    earlier = blocks_taken_before(cfg, sizing)
    if earlier is not None and fit - 2 * (fit // KV_BLOCKS_JITTER) <= earlier <= fit:
        return earlier
    taken = fit - fit // KV_BLOCKS_JITTER
    cache.store_figure(_blocks_key(sizing), taken)
    return taken


def blocks_taken_before(cfg: RunnerConfig, sizing: tuple) -> int | None:
    """The KV blocks the last start with the same `sizing` took (`blocks_as_before`), or None."""
    cache = program_cache_of(cfg)
    return None if cache is None else cache.load_figure(_blocks_key(sizing))


def _blocks_key(sizing: tuple) -> str:
    return hashlib.sha256(repr(("kv blocks", *sizing)).encode()).hexdigest()


def host_tier_bytes(args: EngineArgs, cfg: RunnerConfig, per_block: int) -> int:
    """Device bytes set aside for the host tier's copies on their way (0 without a tier): the
    blocks loading at once (`host_tier.max_loads`), those they evict, and a step's own evictions."""
    if args.kv_offloading_size is None:
        return 0
    return in_flight_bytes(per_block, -(-cfg.max_num_batched_tokens // cfg.block_size) + cfg.max_num_seqs)


def host_tier_max_loads(model: ModelConfig, cfg: RunnerConfig, draft: ModelConfig | None) -> int:
    """The host tier's blocks loading at once, those `host_tier_bytes` sets aside room for."""
    return max_loads(bytes_per_block(model, cfg, draft))


def kv_blocks_that_fit(limit: int, in_use: int, activations: int, utilization: float, per_block: int) -> int:
    """KV blocks in `utilization` of `limit` bytes after what is `in_use` and the step's `activations`."""
    blocks = int(limit * utilization - in_use - activations) // per_block
    if blocks < 1:
        gib = 2**30
        raise ValueError(
            f"no room for a KV cache: the weights and buffers in use ({in_use / gib:.2f} GiB) and the largest "
            f"step's activations ({activations / gib:.2f} GiB) exceed gpu_memory_utilization={utilization} of "
            f"{limit / gib:.2f} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs"
        )
    return blocks


def open_model(args: EngineArgs) -> Checkpoint | None:
    """The checkpoint to load, with its config and weight-file headers checked, so a broken one fails
    before anything slow (None: the built-in model or random weights)."""
    return open_checkpoint(args.model) if args.model is not None and args.load_format == "auto" else None


def held_model_config(args: EngineArgs, checkpoint: Checkpoint | None) -> ModelConfig:
    """The config of the model `load_weights` loads, known before its weights load."""
    if checkpoint is not None:
        config = checkpoint.config
    else:
        config = default_model_config() if args.model is None else dummy_config(args.model)
    return held_config(config, args.quantization)


def load_weights(args: EngineArgs, checkpoint: Checkpoint | None, dtype: str) -> tuple[ModelConfig, Params]:
    """The model's config and weights (the built-in tiny model, the checkpoint, or random weights),
    held in `args.quantization`'s format."""
    held = held_model_config(args, checkpoint)
    if checkpoint is not None:
        return held, checkpoint.load(dtype, held)
    if args.model is None:
        return held_as(*default_model(dtype), args.quantization)
    # Random weights are drawn as they are held, a layer at a time. Drawn dense and quantized after,
    # the dense ones, freed, left the device's pool in pieces too small for the KV cache's arrays
    # (docs/benchmarks.md, fortieth session).
    return held, random_params(held, dtype, args.seed)


def open_draft_model(args: EngineArgs, target: ModelConfig, dtype: str) -> tuple[ModelConfig, Checkpoint | None] | None:
    """The draft model of speculative_config's method "draft_model", before its weights load: its
    config, checked against `target`'s, and its checkpoint (None: the tiny model, or random weights
    in its shape with `load_format` "dummy"). `spec.model` is a checkpoint or the tiny model's
    name, like `model`."""
    spec = args.speculative()
    if not (spec.enabled and spec.method == "draft_model"):
        return None
    dummy = args.load_format == "dummy"
    path = None if dummy else local_model(spec.model, need_tokenizer=False, dtype=dtype)
    checkpoint = None if path is None else open_checkpoint(path)
    config = dummy_config(spec.model) if dummy else default_model_config() if checkpoint is None else checkpoint.config
    args.create_runner_config().check_model(target, config)
    return config, checkpoint


def load_draft_model(args: EngineArgs, draft: tuple[ModelConfig, Checkpoint | None] | None,
                     dtype: str) -> tuple[ModelConfig, Params] | None:
    """The opened draft model (`open_draft_model`) with its weights: random ones drawn as the
    target's, with its seed, under `load_format` "dummy" (a draft of the target's shape is then the
    target)."""
    if draft is None:
        return None
    config, checkpoint = draft
    if args.load_format == "dummy":
        return config, random_params(config, dtype, args.seed)
    return default_model(dtype) if checkpoint is None else (config, checkpoint.load(dtype))


def load_programs_ahead(args: EngineArgs, model: ModelConfig, dtype: str, draft: ModelConfig | None = None
                        ) -> tuple[Programs, int] | None:
    """The programs of the runner `runner_config` will most likely configure, with those the
    program cache holds loaded, and how many (`runner.load_programs`); None where that runner cannot
    be known before the weights load. Compiles nothing: a start calls it while its weights load. It
    only saves time, so a failure is logged and the start goes on without it (the sizing after the
    weights raises what is the start's error)."""
    try:
        cfg = _config_ahead(args, model, dtype, draft)
        return None if cfg is None else load_programs(runner_context(model, cfg, dtype, draft))
    except Exception:
        logger.warning("reading the runner's programs ahead failed; warm-up makes them", exc_info=True)
        return None


def warm_up(args: EngineArgs) -> bool:
    return not args.enforce_eager if args.enforce_eager is not None else platform.on_gpu()
