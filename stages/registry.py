"""Every stage by name: what flows look a stage up in (docs/architecture.md, "The stage contract").

Imports every stage module, torch included; import it where a stage is about to run, not in shard workers.
"""

from __future__ import annotations

from stages import clean, dedup, download, evaluate, pretrain, tokenize, train_tokenizer
from stages.base import Stage

STAGES: dict[str, Stage] = {
    module.STAGE.name: module.STAGE
    for module in (download, clean, dedup, train_tokenizer, tokenize, pretrain, evaluate)
}
