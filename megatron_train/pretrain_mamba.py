"""`torchrun -m megatron_train.pretrain_mamba`: Megatron's deprecated name of `pretrain_hybrid`, the same run."""

from __future__ import annotations

from megatron_train.pretrain_hybrid import main

if __name__ == "__main__":
    main(entry="pretrain_mamba")
