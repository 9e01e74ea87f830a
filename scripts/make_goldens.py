"""Write HF transformers reference outputs for the tiny checkpoints in tests/data/.

For every model in tests/data/models/ this writes tests/data/goldens/<name>.npz with,
for each prompt i: prompt_<i> (int32 ids), logits_<i> (float32 [len, vocab], HF forward
logits at every prompt position) and greedy_<i> (int32 [32], HF greedy generate with
EOS ignored, one prompt at a time, no padding). The CPU suite has no torch and compares
the JAX model against these.

Greedy tokens are only a fair test if the choice is not a near-tie, so every step's
top-1/top-2 margin is checked (on a cache-free forward over prompt + generated); if a
margin is too small this fails, and the model seed in make_tiny_models.py must change.

Run from the repo root, after make_tiny_models.py:
    python scripts/make_goldens.py
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import safetensors
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT / "tests" / "data"
PROMPT_LENS = (5, 13, 29, 40)
PROMPT_SEED = 1234
FIRST_ID = 3  # prompt ids avoid pad/bos/eos (0, 1, 2)
NEW_TOKENS = 32
MIN_MARGIN = 1e-3
# Eager attention: the plainest HF path, and it honours Mistral's sliding window.
ATTN_IMPL = "eager"


def load(model_dir: Path, **overrides: object) -> transformers.PreTrainedModel:
    """Load a checkpoint the way a user would (AutoModel), in float32, eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=ATTN_IMPL, **overrides
    ).eval()


def make_prompts(vocab_size: int) -> list[np.ndarray]:
    """Seeded random prompts of the fixed lengths, ids in [FIRST_ID, vocab)."""
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(FIRST_ID, vocab_size, size=n).astype(np.int32) for n in PROMPT_LENS]


@torch.no_grad()
def forward_logits(model: transformers.PreTrainedModel, ids: np.ndarray) -> np.ndarray:
    """Cache-free forward of one unpadded sequence: float32 logits [len, vocab]."""
    out = model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False)
    return out.logits[0].float().numpy()


@torch.no_grad()
def greedy(model: transformers.PreTrainedModel, ids: np.ndarray) -> np.ndarray:
    """HF greedy generate of exactly NEW_TOKENS tokens; EOS neither stops nor is masked."""
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
    )
    # Also clear the model's own default so generate cannot merge eos back in.
    model.generation_config.eos_token_id = None
    out = model.generate(torch.from_numpy(ids.astype(np.int64))[None], generation_config=config)
    new = out[0, len(ids) :].numpy().astype(np.int32)
    if new.shape != (NEW_TOKENS,):
        raise RuntimeError(f"generate returned {new.shape[0]} new tokens, wanted {NEW_TOKENS}")
    return new


def check_greedy(model: transformers.PreTrainedModel, prompt: np.ndarray, new: np.ndarray) -> float:
    """Check each greedy token is the clear argmax of a cache-free forward; return min margin."""
    logits = forward_logits(model, np.concatenate([prompt, new]))
    steps = logits[len(prompt) - 1 : -1]  # row j predicts new[j]
    top2 = np.sort(steps, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    if not np.array_equal(steps.argmax(-1), new):
        raise RuntimeError("generate (with KV cache) disagrees with a cache-free forward")
    return float(margins.min())


def check_sliding_window(model_dir: Path, prompt: np.ndarray) -> None:
    """Fail unless HF really applies sliding_window: same logits inside it, different past it."""
    window = transformers.AutoConfig.from_pretrained(model_dir).sliding_window
    if len(prompt) <= window + 1:
        raise RuntimeError("prompt too short to test the sliding window")
    windowed = forward_logits(load(model_dir), prompt)
    full = forward_logits(load(model_dir, sliding_window=10 * len(prompt)), prompt)  # a window that hides nothing
    diff = np.abs(windowed - full).max(-1)
    # Query q sees keys q-window+1 .. q, so position `window` is the first to lose one.
    if diff[:window].max() > 1e-5 or diff[window:].min() < 1e-4:
        raise RuntimeError(f"{model_dir.name}: sliding window not applied as expected: {diff}")
    print(f"  sliding window {window} verified (first differing position {window})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=DATA / "models")
    parser.add_argument("--out", type=Path, default=DATA / "goldens")
    parser.add_argument("--only", nargs="*", help="model names (default: every model); the others' goldens stay")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)

    meta_path = args.out / "meta.json"
    min_margins: dict[str, float] = json.loads(meta_path.read_text())["min_greedy_margin"] if args.only else {}
    failures = []
    for model_dir in sorted(p for p in args.models.iterdir() if p.is_dir() and p.name in (args.only or [p.name])):
        name = model_dir.name
        model = load(model_dir)
        prompts = make_prompts(model.config.vocab_size)
        if getattr(model.config, "sliding_window", None) is not None:
            check_sliding_window(model_dir, prompts[-1])

        arrays: dict[str, np.ndarray] = {}
        margins = []
        for i, prompt in enumerate(prompts):
            new = greedy(model, prompt)
            margins.append(check_greedy(model, prompt, new))
            arrays[f"prompt_{i}"] = prompt
            arrays[f"logits_{i}"] = forward_logits(model, prompt).astype(np.float32)
            arrays[f"greedy_{i}"] = new
        min_margins[name] = min(margins)
        print(f"{name}: min greedy margin {min(margins):.4f}")
        if min(margins) < MIN_MARGIN:
            failures.append(f"{name} (margin {min(margins):.2e} < {MIN_MARGIN})")
            continue
        np.savez_compressed(args.out / f"{name}.npz", **arrays)

    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "commands": ["python scripts/make_tiny_models.py", "python scripts/make_goldens.py"],
        "attn_implementation": ATTN_IMPL,
        "prompt_lens": list(PROMPT_LENS),
        "prompt_seed": PROMPT_SEED,
        "new_tokens": NEW_TOKENS,
        "min_greedy_margin": {k: round(v, 6) for k, v in sorted(min_margins.items())},
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    if failures:
        sys.exit(
            "greedy margin too small, change the seed in make_tiny_models.py: "
            + ", ".join(failures)
        )


if __name__ == "__main__":
    main()
