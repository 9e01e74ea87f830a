"""Multi-LoRA: adapters read and given device slots on the host (`adapters.py`), and the slots'
device layout (`slots.py`)."""
