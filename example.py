"""The shortest tour: prompts in, text out. Reads next: jaxrunner/engine/engine.py (`LLMEngine.step`),
then jaxrunner/runner.py (`Runner.step`), then each part it calls.

With no model given, LLM() uses the built-in tiny random model (its text is gibberish); pass
LLM(model="path/to/hf-checkpoint") for a real one.
"""

from jaxrunner import LLM, SamplingParams

llm = LLM()
prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
params = SamplingParams(temperature=0.8, max_tokens=24, seed=0)
for out in llm.generate(prompts, params):
    print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
