"""Spotline: elastic LLM training on preemptible GPUs."""
