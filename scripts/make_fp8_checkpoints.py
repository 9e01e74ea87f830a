"""Write tiny fp8 checkpoints into tests/data/models/, one per layout Hugging Face fp8 releases use,
each beside its dequantized twin (the same weights widened to float32, a plain checkpoint):

    tiny-llama-fp8-channel   compressed-tensors, e4m3 with a scale per output channel (RedHatAI's)
    tiny-llama-fp8-tensor    compressed-tensors, e4m3 with one scale per tensor
    tiny-llama-fp8-block     "fp8", e4m3 with a scale per 32 x 32 block (Qwen's layout; theirs is 128)

The weights are tiny-llama's, its seven projections per layer in fp8; the rest is copied as it is.
Needs only numpy and ml_dtypes (safetensors' own writers have no fp8 for numpy, so the file is
written here: an 8-byte header length, the JSON header, the data). Run from the repo root:

    python scripts/make_fp8_checkpoints.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

MODELS = Path(__file__).resolve().parent.parent / "tests" / "data" / "models"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = 32
DTYPES = {np.dtype(np.float32): "F32", np.dtype(E4M3): "F8_E4M3"}


def compressed_tensors(strategy: str) -> dict:
    scheme = {"num_bits": 8, "type": "float", "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**scheme, "strategy": strategy, "dynamic": False},
                                          "input_activations": {**scheme, "strategy": "token", "dynamic": True}}}}


LAYOUTS = {
    "channel": compressed_tensors("channel"),
    "tensor": compressed_tensors("tensor"),
    "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
}


def quantize(w: np.ndarray, layout: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A weight [out, in] as the layout stores it ({suffix: tensor}), and its dequantized twin."""
    if layout == "block":
        blocks = np.abs(w.reshape(w.shape[0] // BLOCK, BLOCK, w.shape[1] // BLOCK, BLOCK)).max(axis=(1, 3)) / 448
        full = np.repeat(np.repeat(blocks, BLOCK, axis=0), BLOCK, axis=1)
        values = (w / full).astype(E4M3)
        return {"": values, "_scale_inv": blocks.astype(np.float32)}, values.astype(np.float32) * full
    scale = np.abs(w).max(axis=1, keepdims=True) / 448 if layout == "channel" else np.abs(w).max(keepdims=True)[0] / 448
    values = (w / scale).astype(E4M3)
    return {"": values, "_scale": scale.astype(np.float32)}, values.astype(np.float32) * scale


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t).tobytes())


def main() -> None:
    source = MODELS / "tiny-llama"
    weights = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    for layout, spec in LAYOUTS.items():
        stored, twin = {}, {}
        for name, w in weights.items():
            if name.split(".")[-2] in PROJECTIONS:
                parts, twin[name] = quantize(w.astype(np.float32), layout)
                stored.update({name + suffix: t for suffix, t in parts.items()})
            else:
                stored[name] = twin[name] = w
        for out, tensors, quantized in ((f"tiny-llama-fp8-{layout}", stored, True),
                                        (f"tiny-llama-fp8-{layout}-twin", twin, False)):
            path = MODELS / out
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config | ({"quantization_config": spec} if quantized else {}),
                                                         indent=2) + "\n")
            if quantized:
                write_safetensors(path / "model.safetensors", tensors)
            else:
                save_file(tensors, str(path / "model.safetensors"))
            print("wrote", path)


if __name__ == "__main__":
    main()
