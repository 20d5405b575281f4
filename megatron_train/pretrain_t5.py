"""Pretrain T5: `torchrun --nproc-per-node N -m megatron_train.pretrain_t5 <Megatron flags>`.

Megatron's pretrain_t5.py: the T5 family (`megatron_train.families.t5`: encoder-decoder model, span-corruption
datasets, decoder LM loss) in the generic loop: `--encoder-num-layers` / `--decoder-num-layers`,
`--encoder-seq-length` / `--decoder-seq-length`, `--vocab-extra-ids` sentinels, `--split-sentences` data and a
WordPiece tokenizer. Tensor, sequence and data parallelism, the distributed optimizer, bf16/fp16 and recompute
apply; pipeline parallelism is refused, as Megatron-Core's pretrain_t5 does.
"""

from __future__ import annotations

from megatron_train.training.entry import run_pretrain


def main(argv: list[str] | None = None) -> None:
    run_pretrain("pretrain_t5", argv, "t5")


if __name__ == "__main__":
    main()
