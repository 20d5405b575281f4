"""The Retro embedder stage: a Hugging Face BERT directory (all-MiniLM-L6-v2 by default), optionally cut to its
first `num_layers` layers, as an artifact the other Retro stages load (`retro.embedder.load_embedder`).

Cutting keeps the embeddings and the lower layers' real weights and every other file (vocabulary,
sentence-transformers pooling), so the small model pools as the whole one does; `make retro` uses it to embed a
corpus in minutes on two CPU cores. With `num_layers` None the directory is copied as it is. See
docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import save_file

from megatron_train.models.hf_bert import WEIGHT_FILES, read_hf_weights
from stages.base import Inputs, Stage
from stages.retro_params import EmbedderParams
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.atomic import is_temporary
from storage.verify import content_hash


def cut_layers(source: str, num_layers: int, out_dir: str) -> None:
    """`source`'s files in `out_dir` with config.json's num_hidden_layers = `num_layers` and the weights of the
    layers from `num_layers` on dropped (model.safetensors)."""
    with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(
            f"--retro-embedder.num-layers {num_layers}: {source} has {config['num_hidden_layers']} layers; keep "
            "between 1 and all of them"
        )
    config["num_hidden_layers"] = num_layers
    dropped = tuple(f"encoder.layer.{i}." for i in range(num_layers, 1000))
    weights = {
        name: t.contiguous()
        for name, t in read_hf_weights(source).items()
        if not name.removeprefix("bert.").startswith(dropped)
    }
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


class RetroEmbedderStage(Stage):
    name = "retro_embedder"
    version = "1"
    libraries = ("torch", "safetensors")
    Params = EmbedderParams

    def key_params(self, params: EmbedderParams) -> dict:
        return {"source": content_hash(params.source_path()), "num_layers": params.num_layers}

    def run(self, params: EmbedderParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """The embedder directory as an artifact (no inputs: the source is a local directory)."""
        source = params.source_path()

        def build(writer: ArtifactWriter) -> dict:
            out_dir = os.path.join(writer.local_dir, "embedder")
            files = {}
            for root, _, names in os.walk(source):
                for name in names:
                    relative = os.path.relpath(os.path.join(root, name), source)
                    if is_temporary(name) or (params.num_layers is not None and relative in WEIGHT_FILES):
                        continue
                    os.makedirs(os.path.dirname(os.path.join(out_dir, relative)), exist_ok=True)
                    files[relative] = shutil.copyfile(
                        os.path.join(root, name), os.path.join(out_dir, relative)
                    )
            if params.num_layers is not None:
                cut_layers(source, params.num_layers, out_dir)
                files |= {name: os.path.join(out_dir, name) for name in ("config.json", "model.safetensors")}
            writer.commit_shard("embedder", files)
            return {"source": source}

        return self.build_artifact(params, inputs, store, build)


STAGE = RetroEmbedderStage()
run = STAGE.run
key = STAGE.key
