"""Evaluation tasks: Megatron's tasks/main.py command line (zero-shot GPT: WIKITEXT103, LAMBADA, VALID_PPL) and
lm-eval's own command line with this project's model (`tasks.lm_eval`)."""
