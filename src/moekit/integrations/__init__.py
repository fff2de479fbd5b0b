"""Bridges to the stacks users already run: checkpoints (gpt-oss safetensors), Hugging Face models."""
