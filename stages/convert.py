"""The convert stage: a trained run (the pretrain artifact) as a Hugging Face folder, or as a checkpoint of another
format of the converter (`megatron_train.convert`), so checkpoint conversion is a node of the DAG
(docs/architecture.md, "The stage contract").

The artifact holds what `python -m megatron_train.tools.checkpoint_util --loader flow --saver <saver>` writes:
for `hf`, `config.json`, `model.safetensors` (or shards and their index) and the run's tokenizer files, a folder
`transformers.AutoModelForCausalLM.from_pretrained` and vLLM load. The conversion runs in the writer's scratch
folder and its files move into the artifact only when it is complete, so a killed conversion leaves no partial
artifact and a rerun starts it again.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

from megatron_train import convert
from megatron_train.tools.checkpoint_util import convert_format
from stages.base import Inputs, Stage, expect_inputs
from stages.pretrain import run_directory
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter

log = logging.getLogger("megatron_flow.stage.convert")

# The pretrain artifact is a checkpoint of our own format already: reshard it with checkpoint_util instead.
SAVERS = tuple(saver for saver in convert.FORMATS if saver != "flow")


@dataclass(frozen=True)
class ConvertParams:
    """Which format to write and which of the run's checkpoints; the defaults give a Hugging Face folder of the
    run's last checkpoint."""

    saver: str = "hf"  # a format of megatron_train.convert other than our own ("flow")
    iteration: int | None = None  # None: the run's latest checkpoint
    target_tensor_parallel_size: int = 1  # checkpoint formats only: `hf` writes one unsplit model
    target_pipeline_parallel_size: int = 1
    max_shard_size: int = 5 * 10**9  # `hf`: bytes per safetensors file


def _convert(params: ConvertParams, pretrained: ArtifactRef, writer: ArtifactWriter) -> dict:
    out = os.path.join(writer.local_dir, "converted")
    shutil.rmtree(out, ignore_errors=True)  # a killed attempt's files: the conversion starts again
    weights = convert_format(
        "flow",
        params.saver,
        run_directory(pretrained),
        out,
        params.target_tensor_parallel_size,
        params.target_pipeline_parallel_size,
        iteration=params.iteration,
        max_shard_size=params.max_shard_size,
    )
    for folder, _, names in os.walk(out):
        for name in names:
            path = os.path.join(folder, name)
            writer.put_file(path, os.path.relpath(path, out))
    parameters = sum(tensor.numel() for tensor in weights.tensors.values())
    log.info("convert: %s iteration %d as %s (%d parameters)", pretrained.url, weights.iteration,
             params.saver, parameters)  # fmt: skip
    return {"format": params.saver, "iteration": weights.iteration, "counts": {"parameters": parameters}}


class ConvertStage(Stage):
    name = "convert"
    version = "1"
    libraries = ("torch", "safetensors")
    Params = ConvertParams

    def run(self, params: ConvertParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Convert the trained run of `inputs` ([pretrain artifact]) to `params.saver`'s format."""
        (pretrained,) = expect_inputs(self, inputs, 1, "[pretrain artifact]")
        if params.saver not in SAVERS:
            raise ValueError(
                f"convert stage: saver {params.saver!r} is not one of {', '.join(SAVERS)} (the pretrain artifact "
                "is a checkpoint of our own format already; reshard it with python -m "
                "megatron_train.tools.checkpoint_util)"
            )
        return self.build_artifact(params, inputs, store, lambda writer: _convert(params, pretrained, writer))


STAGE = ConvertStage()
run = STAGE.run
key = STAGE.key
