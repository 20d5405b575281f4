"""Pretraining data: Megatron-Core's GPT, BERT and T5 datasets, BlendedDataset, dataset builder and samplers."""

from megatron_train.data.bert_dataset import BERTDatasetConfig
from megatron_train.data.builder import (
    build_masked_train_valid_test_datasets,
    build_train_valid_test_datasets,
)
from megatron_train.data.config import DataConfig
from megatron_train.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megatron_train.data.t5_dataset import T5DatasetConfig

__all__ = [
    "BERTDatasetConfig",
    "DataConfig",
    "MegatronPretrainingSampler",
    "T5DatasetConfig",
    "build_masked_train_valid_test_datasets",
    "build_pretraining_data_loader",
    "build_train_valid_test_datasets",
]
