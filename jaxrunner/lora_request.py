"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from jaxrunner.checks import check_int


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` is what the server's `model` field names; `lora_int_id` (>= 1) identifies the
    adapter everywhere else (slots, the prefix cache); `lora_path` is a PEFT adapter directory
    (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        check_int("LoRARequest", "lora_int_id", self.lora_int_id, 1)
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"LoRARequest: lora_path must be a directory path, got {self.lora_path!r}")
