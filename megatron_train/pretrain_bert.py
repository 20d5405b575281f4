"""Pretrain BERT: `torchrun --nproc-per-node N -m megatron_train.pretrain_bert <Megatron flags>`.

Megatron's pretrain_bert.py: the BERT family (`megatron_train.families.bert`: model, masked sentence-pair
datasets, masked-LM + sentence-order loss) in the generic loop. Data: `--split-sentences` output and a WordPiece
tokenizer (`--tokenizer-type BertWordPieceLowerCase --vocab-file ...`); `--bert-no-binary-head` drops the
sentence-order head and loss.
"""

from __future__ import annotations

from megatron_train.training.entry import run_pretrain


def main(argv: list[str] | None = None) -> None:
    run_pretrain("pretrain_bert", argv, "bert")


if __name__ == "__main__":
    main()
