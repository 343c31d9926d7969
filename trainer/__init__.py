"""Flywheel trainer: GRPO and SFT with LoRA on verifiable rewards, run as `python -m trainer` (see README.md)."""
