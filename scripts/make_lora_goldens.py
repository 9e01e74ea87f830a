"""Write tiny random PEFT LoRA adapters and Hugging Face + PEFT reference outputs for them.

Each adapter in ADAPTERS is made by PEFT itself (`get_peft_model`, then `save_pretrained`), so its
adapter_config.json and adapter_model.safetensors are exactly what users load, with lora_A and
lora_B drawn at random (PEFT starts B at zero, which would make the adapter a no-op). They go to
tests/data/loras/<name>/. For each adapter and each of make_goldens.py's prompts,
tests/data/goldens/lora.npz gets greedy_<name>_<i> (int32 [NEW_TOKENS], PEFT's greedy generate, EOS
ignored) and logits_<name>_<i> (float32 [len, vocab], the cache-free forward over the prompt);
every greedy step's top-1/top-2 margin is checked as make_goldens.py does.

Run from the repo root in make_goldens.py's environment plus peft (tests/data/README.md):
    python scripts/make_lora_goldens.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import peft
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import DATA, MIN_MARGIN, NEW_TOKENS, check_greedy, forward_logits, greedy, load, make_prompts  # noqa: E402

# name: (base model, rank, alpha, target modules, rslora, seed)
ADAPTERS = {
    "llama-qv-r4": ("tiny-llama", 4, 8, ["q_proj", "v_proj"], False, 1),
    "llama-all-r8": ("tiny-llama", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     False, 2),
    "llama-mlp-r16-rslora": ("tiny-llama", 16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], True, 3),
    "qwen3-kod-r8": ("tiny-qwen3", 8, 8, ["k_proj", "o_proj", "down_proj"], False, 4),
}
LORA_STD = 0.15


def make_adapter(name: str, out: Path) -> peft.PeftModel:
    base, rank, alpha, targets, rslora, seed = ADAPTERS[name]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                             bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(load(DATA / "models" / base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_STD)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    (out / "README.md").unlink()  # PEFT's model-card template
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = f"tests/data/models/{base}"  # not this machine's absolute path
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return model.eval()


def main() -> None:
    torch.set_num_threads(1)
    arrays, margins, failures = {}, {}, []
    for name, (base, *_) in ADAPTERS.items():
        make_adapter(name, DATA / "loras" / name)
        # Read back the way users do: the base checkpoint, then the saved adapter.
        model = peft.PeftModel.from_pretrained(load(DATA / "models" / base), DATA / "loras" / name).eval()
        model.generation_config.eos_token_id = None
        worst = float("inf")
        for i, prompt in enumerate(make_prompts(model.config.vocab_size)):
            new = greedy(model, prompt)
            worst = min(worst, check_greedy(model, prompt, new))
            arrays[f"greedy_{name}_{i}"] = new
            arrays[f"logits_{name}_{i}"] = forward_logits(model, prompt).astype(np.float32)
        margins[name] = round(worst, 6)
        print(f"{name}: min greedy margin {worst:.4f}")
        if worst < MIN_MARGIN:
            failures.append(name)
    np.savez_compressed(DATA / "goldens" / "lora.npz", **arrays)
    meta = {"peft": peft.__version__, "torch": torch.__version__, "command": "python scripts/make_lora_goldens.py",
            "new_tokens": NEW_TOKENS, "adapters": {k: list(v[:5]) for k, v in ADAPTERS.items()},
            "min_greedy_margin": margins}
    (DATA / "goldens" / "lora_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if failures:
        sys.exit(f"greedy margin too small for {failures}: change their seeds in ADAPTERS")


if __name__ == "__main__":
    main()
