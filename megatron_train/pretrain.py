"""Pretrain any model family: `torchrun --nproc-per-node N -m megatron_train.pretrain --model-family FAMILY
<Megatron flags>`, FAMILY a family of this project (default gpt) or `pkg.module:ATTR` naming one defined elsewhere
(docs/architecture.md, model families). The `pretrain_*` entry points are this with their family as default.
"""

from __future__ import annotations

from megatron_train.training.entry import run_pretrain


def main(argv: list[str] | None = None) -> None:
    run_pretrain("pretrain", argv, "gpt")


if __name__ == "__main__":
    main()
