"""Hf: Hugging Face checkpoints in and out (safetensors), and the transformers models they match."""
