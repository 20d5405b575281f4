"""Evaluation tasks with Megatron's tasks/main.py command line (zero-shot GPT: WIKITEXT103, LAMBADA)."""
