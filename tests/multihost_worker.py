"""One process of test_tensor_parallel's two-process run: `python multihost_worker.py RANK PORT`.

Two CPU devices here, two in the other process: `jax.distributed.initialize` (gloo collectives on
CPU) joins them into one mesh of four, and each process runs the same engine on the same prompts
(SPMD), as every host of a multi-host deployment does. Prints the greedy tokens as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"

import jax  # noqa: E402  (after XLA_FLAGS)

DATA = Path(__file__).parent / "data"


def main(rank: int, port: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import numpy as np

    from jaxrunner import LLM, SamplingParams

    g = np.load(DATA / "goldens" / "tiny-llama.npz")
    prompts = [g[f"prompt_{i}"].tolist() for i in range(4)]
    with LLM(str(DATA / "models" / "tiny-llama"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
             tensor_parallel_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
                      "tokens": [o.outputs[0].token_ids for o in outs]}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
