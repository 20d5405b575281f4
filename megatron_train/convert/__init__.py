"""Checkpoint conversion between formats, as Megatron's tools/checkpoint/convert.py: a loader reads a model into
`ModelWeights` (config, whole tensors under our global names, tokenizer files), a saver writes them
(docs/architecture.md, checkpoints). One module per format: `flow` (ours), `hf` (Hugging Face), `megatron` (Megatron-LM's legacy `torch`
format), `torch_dist` (Megatron-Core's distributed checkpoint).
`python -m megatron_train.tools.checkpoint_util --loader L --saver S` is the command line.
"""

from megatron_train.convert.weights import ModelWeights

FORMATS = ("flow", "hf", "megatron", "torch_dist")

__all__ = ["FORMATS", "ModelWeights"]
