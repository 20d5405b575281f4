"""Megatron's name for serving a Mamba or hybrid checkpoint (tools/run_hybrid_text_generation_server.py): the same
server as `run_text_generation_server`, reading `--load` as the hybrid family's unless `--model-family` says
otherwise, so a Megatron-LM hybrid checkpoint (whose files do not record their family) is served as one."""

from __future__ import annotations

import sys

from megatron_train.tools.run_text_generation_server import main as serve


def hybrid_argv(argv: list[str]) -> list[str]:
    """`argv` with `--model-family hybrid` first unless it names a family."""
    named = any(word == "--model-family" or word.startswith("--model-family=") for word in argv)
    return argv if named else ["--model-family", "hybrid", *argv]


def main(argv: list[str] | None = None) -> None:
    serve(hybrid_argv(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
