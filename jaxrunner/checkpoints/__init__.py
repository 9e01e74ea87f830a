"""Checkpoints in: Hugging Face safetensors, GGUF files and converted params saved with orbax."""
