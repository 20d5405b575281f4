"""Pretrain a Mamba or hybrid Mamba-Transformer model: `torchrun --nproc-per-node N -m megatron_train.pretrain_hybrid
--hybrid-layer-pattern M-M*... <Megatron flags>`.

Megatron's pretrain_hybrid.py: the hybrid family (`megatron_train.families.hybrid`: MambaModel on the GPT datasets
and loss) in the generic loop (`training.entry.run_pretrain`). `pretrain_mamba` is its older name.
"""

from __future__ import annotations

from megatron_train.training.entry import run_pretrain


def main(argv: list[str] | None = None, entry: str = "pretrain_hybrid") -> None:
    run_pretrain(entry, argv, "hybrid")


if __name__ == "__main__":
    main()
