"""Megatron-Core's BlendedDataset: samples drawn from several datasets in fixed proportions.

Sample i comes from dataset `dataset_index[i]`, as its `dataset_sample_index[i]`-th sample; the order
is Megatron's greedy one (always serve the dataset furthest behind its share), built by
`indices.build_blending_indices` and cached like the GPT indices.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from megatron_train.data.indices import build_blending_indices, load_or_build_indices, normalize_weights


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples from `datasets` in proportion to `weights` (normalised here)."""

    def __init__(
        self, datasets: list[torch.utils.data.Dataset], weights: list[float], size: int, cache_dir: str | None
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.weights = normalize_weights(weights).tolist()
        self.size = size
        self.unique_description = json.dumps(
            {
                "class": type(self).__name__,
                "datasets": [json.loads(dataset.unique_description) for dataset in datasets],
                "weights": self.weights,
                "size": size,
            },
            indent=4,
        )
        arrays = load_or_build_indices(
            cache_dir,
            self.unique_description,
            type(self).__name__,
            ("dataset_index", "dataset_sample_index"),
            self._build_indices,
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_bounds()

    def _build_indices(self) -> dict[str, np.ndarray]:
        dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def _check_bounds(self) -> None:
        """Every dataset must hold the samples the blend asks of it."""
        used = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, dataset in enumerate(self.datasets):
            if used[i] > len(dataset):
                name = getattr(dataset, "dataset_path", None) or f"dataset {i}"
                raise ValueError(
                    f"{name}: the blend draws {used[i]} samples from it but it has {len(dataset)}; "
                    "build that dataset with at least as many samples as the blend draws"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for BlendedDataset of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
