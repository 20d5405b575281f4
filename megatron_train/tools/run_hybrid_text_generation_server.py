"""Megatron's name for serving a Mamba or hybrid checkpoint (tools/run_hybrid_text_generation_server.py): the same
server as `run_text_generation_server`, which serves every family's checkpoint by what the checkpoint records."""

from __future__ import annotations

from megatron_train.tools.run_text_generation_server import main

if __name__ == "__main__":
    main()
