"""lm-eval's own command line with the megatron-flow model registered (see docs/architecture.md).

    python -m megatron_train.tasks.lm_eval --model megatron-flow --model_args load=CKPT --tasks lambada_openai \\
        [--batch_size 8] [--include_path MY_TASKS] [--output_path OUT] [any other lm-eval flag]

lm-eval (0.4) looks models up in its registry and has no plugin entry point for them, so its `lm_eval`
command cannot know "megatron-flow"; this module imports the adapter, which registers it, and then runs that
command with the same flags. `--model_args` keys: load, ckpt_step, tokenizer_type, vocab_file, merge_file,
tokenizer_model, vocab_size, batch_size, max_length.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise SystemExit("lm-eval is not installed: pip install lm-eval (or megatron-flow[dev])") from None
    import megatron_train.evaluation.lm_eval_adapter  # noqa: F401 (registers the "megatron-flow" model)

    if argv is not None:  # lm-eval's command reads sys.argv
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
