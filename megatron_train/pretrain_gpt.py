"""Pretrain a GPT/Llama model: `torchrun --nproc-per-node N -m megatron_train.pretrain_gpt <Megatron flags>`.

Megatron's pretrain_gpt.py: the GPT family (`megatron_train.families.gpt`: model, datasets, loss) in the generic
loop (`training.entry.run_pretrain`).
"""

from __future__ import annotations

from megatron_train.training.entry import run_pretrain


def main(argv: list[str] | None = None) -> None:
    run_pretrain("pretrain_gpt", argv, "gpt")


if __name__ == "__main__":
    main()
