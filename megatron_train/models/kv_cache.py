"""Keys and values of past tokens, so generation feeds only new tokens through the model."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer key/value buffers [batch, max_seq_len, num_kv_heads, head_dim] for this TP rank's heads.

    `num_layers` is the layers this pipeline stage holds and `num_kv_heads` this TP rank's share.
    The model writes each layer's new keys/values at `seq_len_offset` and advances the offset by the
    number of new tokens after its forward; `reset()` starts a new sequence.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, batch_size, max_seq_len, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.seq_len_offset = 0

    def reset(self) -> None:
        self.seq_len_offset = 0

    def reorder(self, order: torch.Tensor) -> None:
        """Row i continues from row `order[i]`'s past (beam search keeps the beams it extends)."""
        rows = order.numel()
        self.keys[:, :rows] = self.keys[:, order]
        self.values[:, :rows] = self.values[:, order]

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new key/value [b, s_new, kv_heads, d] at the offset; return all keys/values so far
        [b, offset + s_new, kv_heads, d]."""
        batch, new = key.shape[0], key.shape[1]
        end = self.seq_len_offset + new
        if end > self.max_seq_len or batch > self.keys.shape[1]:
            raise ValueError(
                f"KV cache holds batch {self.keys.shape[1]} x {self.max_seq_len} tokens; cannot add batch {batch} "
                f"x {new} tokens at offset {self.seq_len_offset}: allocate a larger cache or call reset()"
            )
        self.keys[layer, :batch, self.seq_len_offset : end] = key
        self.values[layer, :batch, self.seq_len_offset : end] = value
        return self.keys[layer, :batch, :end], self.values[layer, :batch, :end]
