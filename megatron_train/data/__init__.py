"""GPT pretraining data: Megatron-Core's GPTDataset, BlendedDataset, dataset builder and samplers."""

from megatron_train.data.builder import build_train_valid_test_datasets
from megatron_train.data.config import DataConfig
from megatron_train.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader

__all__ = [
    "DataConfig",
    "MegatronPretrainingSampler",
    "build_pretraining_data_loader",
    "build_train_valid_test_datasets",
]
