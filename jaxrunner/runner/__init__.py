"""The model runner: the host step (`runner.py`, `input_batch.py`), its compiled programs
(`programs.py`) and the device step they run (`step.py` over `state.py`); the memory it will take
(`memory.py`) and its largest step's (`largest_step_bytes`), for the engine to size the KV cache
before the runner exists, and the programs a start can load while its weights load (`load_programs`)."""

from jaxrunner.runner.memory import bytes_per_block, kv_cache_bytes, lora_bytes
from jaxrunner.runner.programs import Programs, program_cache_of
from jaxrunner.runner.runner import Runner, largest_step_bytes, load_programs, runner_context, stored_step_bytes

__all__ = ["Programs", "Runner", "bytes_per_block", "kv_cache_bytes", "largest_step_bytes", "load_programs", "lora_bytes",
           "program_cache_of", "runner_context", "stored_step_bytes"]
