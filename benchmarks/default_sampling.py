"""How the built-in model's sampling defaults were chosen: 20 plain questions, each asked alone through
`LLM.chat` with the default model (SmolLM2-135M-Instruct), under a few candidate settings.

The count printed is a first sieve: an answer that ends at the model's end of turn within
`MAX_TOKENS` tokens and names the expected answer (one of its accepted spellings, as a whole word,
case-insensitive). A small model often names the right answer and then a conflicting one, so the
answers were then judged by reading them (docs/default_sampling.md has the criterion and verdicts).
Sampled candidates ask each question with seeds 0..SEEDS-1 and count the mean over the seeds.

    python benchmarks/default_sampling.py                  # every candidate, answers to stdout
    python benchmarks/default_sampling.py --json out.json  # and every answer to a file
    python benchmarks/default_sampling.py --candidates greedy+rep1.1
"""

from __future__ import annotations

import argparse
import json
import re

from jaxrunner import LLM, SamplingParams

# (question, accepted spellings of the answer)
QUESTIONS = (
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("How many legs does a spider have?", ("eight", "8")),
    ("How many continents are there on Earth?", ("seven", "7")),
    ("What is 2 + 2?", ("four", "4")),
    ("What is the largest planet in our solar system?", ("Jupiter",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("Who painted the Mona Lisa?", ("Leonardo", "da Vinci")),
    ("At what temperature in degrees Celsius does water boil at sea level?", ("100",)),
    ("What color do you get when you mix blue and yellow?", ("green",)),
    ("What is the chemical symbol for gold?", ("Au",)),
    ("Which ocean is the largest?", ("Pacific",)),
    ("What gas do plants take in from the air to make food?", ("carbon dioxide", "CO2")),
    ("What is the tallest mountain in the world?", ("Everest",)),
    ("What language is spoken in Brazil?", ("Portuguese",)),
    ("What is the opposite of hot?", ("cold",)),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What do bees make?", ("honey",)),
)
MAX_TOKENS = 256
SEEDS = 3
CANDIDATES = {
    "vllm (temperature 1.0)": {},
    "greedy": {"temperature": 0.0},
    "greedy+rep1.05": {"temperature": 0.0, "repetition_penalty": 1.05},
    "greedy+rep1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
    "greedy+rep1.15": {"temperature": 0.0, "repetition_penalty": 1.15},
    "greedy+rep1.2": {"temperature": 0.0, "repetition_penalty": 1.2},
    "t0.2+top_p0.9 (model card)": {"temperature": 0.2, "top_p": 0.9},
    "t0.2+top_p0.9+rep1.1": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
}


def sieve(answer: str, accepted: tuple[str, ...], finish_reason: str) -> bool:
    return finish_reason == "stop" and any(re.search(rf"\b{re.escape(a)}\b", answer, re.IGNORECASE) for a in accepted)


def run(llm: LLM, settings: dict) -> list[dict]:
    """One answer per question and seed (one seed when greedy)."""
    seeds = [0] if settings.get("temperature", 1.0) == 0.0 else list(range(SEEDS))
    asks = [(q, accepted, seed) for q, accepted in QUESTIONS for seed in seeds]
    params = [SamplingParams(**settings, max_tokens=MAX_TOKENS, seed=seed) for _, _, seed in asks]
    outputs = llm.chat([[{"role": "user", "content": q}] for q, _, _ in asks], params, use_tqdm=False)
    return [{"question": q, "seed": seed, "answer": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
             "tokens": len(out.outputs[0].token_ids), "sieve": sieve(out.outputs[0].text, accepted,
                                                                      out.outputs[0].finish_reason)}
            for (q, accepted, seed), out in zip(asks, outputs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", choices=sorted(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--json", metavar="PATH", help="write every answer there")
    args = parser.parse_args()
    results = {}
    # Prefix caching off, as in the run docs/default_sampling.md records (it ran before the runner
    # wrote a cached prefix's token row, when a cache hit skewed the repetition penalty).
    with LLM(max_model_len=1024, max_num_seqs=20, max_num_batched_tokens=512, enable_prefix_caching=False) as llm:
        for name in args.candidates:
            answers = results[name] = run(llm, CANDIDATES[name])
            share = sum(a["sieve"] for a in answers) / len(answers)
            stopped = sum(a["finish_reason"] == "stop" for a in answers)
            print(f"## {name}: {share * len(QUESTIONS):.1f}/{len(QUESTIONS)} pass the sieve, {stopped}/{len(answers)} "
                  f"ended their turn, {sum(a['tokens'] for a in answers) / len(answers):.0f} tokens on average",
                  flush=True)
            for a in answers:
                print(f"- [{'x' if a['sieve'] else ' '}] {a['question']} (seed {a['seed']}): {a['answer']!r}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": CANDIDATES, "max_tokens": MAX_TOKENS, "answers": results}, f, indent=1)


if __name__ == "__main__":
    main()
