"""The model runner: the host step (`runner.py`, `input_batch.py`), its compiled programs
(`programs.py`) and the device step they run (`step.py` over `state.py`)."""

from jaxrunner.runner.runner import Runner

__all__ = ["Runner"]
