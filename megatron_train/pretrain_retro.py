"""Pretrain Retro: `torchrun --nproc-per-node N -m megatron_train.pretrain_retro --retro-project-dir DIR
--retro-add-retriever <Megatron flags>`, as Megatron's pretrain_retro.py: the Retro family (`retro.family`: the
project's settings, data and neighbours, retro-fitting from a GPT checkpoint, InstructRetro SFT) in the generic
loop. The training engine imports nothing of `retro`: the family is looked up by its name, as every family is
(docs/architecture.md, model families).
"""

from __future__ import annotations

from megatron_train.training.entry import run_pretrain


def main(argv: list[str] | None = None) -> None:
    run_pretrain("pretrain_retro", argv, "retro")


if __name__ == "__main__":
    main()
