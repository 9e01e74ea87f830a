"""LoRA adapters on the host: PEFT files read and checked, and which adapter holds which device slot.

An adapter is a PEFT LoRA directory: `adapter_config.json` (r, lora_alpha, use_rslora, ...) and
`adapter_model.safetensors`, whose tensors `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r] add scaling * B A to a projection (scaling alpha / r, or
alpha / sqrt(r) with rslora). `read_adapter` turns them into one slot's tensors in `models.lora`'s
layout (padded to max_lora_rank, the scaling folded into B), or raises a ValueError that names the
file and what is wrong with it: the engine then fails that request alone.

`Adapters` is the runner's registry: the adapters it was given (kept parsed, least recently used
dropped past `max_cpu_loras`; re-read from their path when needed again) and the device slots, also
least recently used first: a batch's adapters are made resident before its step, evicting adapters
the batch does not use. Writing a slot is one compiled program, whatever the adapter.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from jaxrunner.config import LoraConfig, ModelConfig
from jaxrunner.checkpoints.loader import SafetensorsFiles
from jaxrunner.lora_request import LoRARequest
from jaxrunner.lora.slots import projection_parts
from jaxrunner.models.tensors import LORA_TARGETS

# PEFT's module name -> (our projection, its part): PEFT names a part by its Hugging Face module.
MODULES = {source.hf.split(".")[-2]: (weight.name, part)
           for weight in LORA_TARGETS for part, source in enumerate(weight.sources)}
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class Adapter:
    """One adapter read for the runner: `parts[(layer, projection, part)] = (a [in, R], b [R, out])`,
    zero-padded to R = max_lora_rank with the scaling in b; projections it does not target are zero."""

    request: LoRARequest
    parts: dict[tuple[int, str, int], tuple[np.ndarray, np.ndarray]]

    def slot_tensors(self, model: ModelConfig, max_rank: int, dtype) -> tuple:
        """One slot's tensors for `models.lora.write_slot` (b block diagonal over the parts)."""
        layers = []
        for i in range(model.num_layers):
            layer = {}
            for name, (width, outs) in projection_parts(model).items():
                a = np.zeros((width, len(outs) * max_rank), dtype)
                b = np.zeros((len(outs) * max_rank, sum(outs)), dtype)
                col = 0
                for p, out in enumerate(outs):
                    rows = slice(p * max_rank, (p + 1) * max_rank)
                    if (i, name, p) in self.parts:
                        a[:, rows], b[rows, col : col + out] = self.parts[i, name, p]
                    col += out
                layer[name] = {"a": a, "b": b}
            layers.append(layer)
        return tuple(layers)


def read_adapter(request: LoRARequest, model: ModelConfig, lora: LoraConfig) -> Adapter:
    path = os.fspath(request.lora_path)
    where = f"LoRA adapter {request.lora_name!r} ({path})"

    def bad(msg: str) -> None:
        raise ValueError(f"{where}: {msg}")

    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        bad("no such directory; lora_path must be a PEFT adapter directory")
    for file in (config_path, weights_path):
        if not os.path.isfile(file):
            bad(f"{os.path.basename(file)} is missing; a PEFT LoRA adapter holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        bad(f"cannot read {CONFIG_FILE}: {e}")
    if not isinstance(config, dict):
        bad(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        bad(f"peft_type is {config['peft_type']!r}; only LoRA adapters (peft_type 'LORA') are supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if type(rank) is not int or rank < 1:
        bad(f"r must be a positive integer, got {rank!r}")
    if rank > lora.max_lora_rank:
        bad(f"its rank {rank} exceeds max_lora_rank={lora.max_lora_rank}; raise max_lora_rank")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        bad(f"lora_alpha must be a number, got {alpha!r}")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False)):
        if config.get(key, off) not in (off, None):
            bad(f"{key}={config[key]!r} is not supported (jaxrunner applies plain LoRA: {key}={off!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication", "target_parameters",
                "trainable_token_indices", "alora_invocation_tokens"):
        if config.get(key):
            bad(f"{key} is not supported; it must be empty")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    try:
        files = SafetensorsFiles([weights_path])
    except ValueError as e:
        bad(str(e))
    shapes = {name: files.shape(name) for name in files.tensors}
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in shapes:
        match = _TENSOR.fullmatch(name)
        if match is None:
            bad(f"tensor {name!r} is not a LoRA weight of a decoder layer's projection; supported target modules: "
                f"{', '.join(MODULES)}")
        layer, module, ab = int(match[1]), match[2], match[3]
        if module not in MODULES:
            bad(f"unknown target module {module!r}; supported: {', '.join(MODULES)}")
        if layer >= model.num_layers:
            bad(f"tensor {name!r} is for layer {layer}, but the model has {model.num_layers} layers")
        found.setdefault((layer, module), {})[ab] = name
    if not found:
        bad(f"{WEIGHTS_FILE} holds no LoRA weights")

    parts = {}
    projections = projection_parts(model)
    for (layer, module), names in sorted(found.items()):
        if set(names) != {"A", "B"}:
            bad(f"layer {layer} {module}: lora_A and lora_B go together, found only lora_{''.join(names)}")
        name, part = MODULES[module]
        if name not in projections:  # a Mixture-of-Experts MLP: its experts take no adapter
            targets = [m for m, (n, _) in MODULES.items() if n in projections]
            bad(f"target module {module!r} is not in this model ({model.architecture}: its MLP is a Mixture of "
                f"Experts, whose experts take no adapter); supported target modules: {', '.join(targets)}")
        width, out = projections[name][0], projections[name][1][part]
        for ab, want in (("A", (rank, width)), ("B", (out, rank))):
            if shapes[names[ab]] != want:
                bad(f"{names[ab]} has shape {list(shapes[names[ab]])}, expected {list(want)} (r={rank} for this model)")
        a = np.zeros((width, lora.max_lora_rank), np.float32)
        b = np.zeros((lora.max_lora_rank, out), np.float32)
        a[:, :rank] = np.asarray(files.read(names["A"]), np.float32).T
        b[:rank] = np.asarray(files.read(names["B"]), np.float32).T * scaling
        parts[layer, name, part] = (a, b)
    return Adapter(request, parts)


class Adapters:
    """The adapters a runner knows, and the device slots. `slot_values` maps adapter ids to the value
    a token carries (device slot + 1; 0 is the base model)."""

    def __init__(self, model: ModelConfig, lora: LoraConfig) -> None:
        self.model, self.config = model, lora
        self._requests: dict[int, LoRARequest] = {}
        self._parsed: OrderedDict[int, Adapter] = OrderedDict()
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, least recently used first
        self.num_slot_writes = 0

    def add(self, request: LoRARequest) -> Adapter:
        """Read and check the adapter (once: it is kept by id). A ValueError if it cannot run."""
        if not self.config.enabled:
            raise ValueError(f"LoRA adapter {request.lora_name!r} given, but LoRA is off: set enable_lora=True "
                             "(--enable-lora) and max_loras")
        known = self._requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} at {known.lora_path}; "
                             f"{request.lora_name!r} at {request.lora_path} needs an id of its own")
        adapter = self._parsed.get(request.lora_int_id)
        if adapter is None:
            adapter = read_adapter(request, self.model, self.config)
            self._parsed[request.lora_int_id] = adapter
            while len(self._parsed) > self.config.host_capacity:
                self._parsed.popitem(last=False)
        self._parsed.move_to_end(request.lora_int_id)
        self._requests[request.lora_int_id] = request
        return adapter

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its slot is then free); whether it was known."""
        self._parsed.pop(lora_id, None)
        self._slots.pop(lora_id, None)
        return self._requests.pop(lora_id, None) is not None

    def requests(self) -> list[LoRARequest]:
        return list(self._requests.values())

    def activate(self, lora_ids: set[int]) -> tuple[dict[int, int], list[tuple[int, Adapter]]]:
        """Make `lora_ids` resident: their slot values, and the (slot, adapter) writes that needs, into
        free slots first, then those of the least recently used adapters outside `lora_ids`."""
        if len(lora_ids) > self.config.max_loras:
            raise ValueError(f"a step uses {len(lora_ids)} LoRA adapters, more than max_loras={self.config.max_loras}")
        writes = []
        for lora_id in sorted(lora_ids - self._slots.keys()):
            used = set(self._slots.values())
            free = [s for s in range(self.config.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._slots if i not in lora_ids)
                slot = self._slots.pop(victim)
            self._slots[lora_id] = slot
            writes.append((slot, self.add(self._requests[lora_id])))
        for lora_id in lora_ids:
            self._slots.move_to_end(lora_id)
        self.num_slot_writes += len(writes)
        return {i: self._slots[i] + 1 for i in lora_ids}, writes
