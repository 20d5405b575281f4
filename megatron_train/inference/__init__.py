"""Text generation: sampling, the decoding loop with a KV cache, and the HTTP server."""

from megatron_train.inference.generation import GenerationOutput, GenerationParams, generate
from megatron_train.inference.sampling import sample

__all__ = ["GenerationOutput", "GenerationParams", "generate", "sample"]
