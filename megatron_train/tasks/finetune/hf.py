"""Task records from a Hugging Face dataset the user has locally: a folder written by `save_to_disk`, or a
hub name (`glue/mnli`, `race/all`) found in the `datasets` cache. Column names are those of the hub datasets;
class labels are mapped by name to Megatron's ids, so a model finetuned from either source agrees.
"""

from __future__ import annotations

import os

from megatron_train.tasks.finetune.glue import MNLI_LABELS
from megatron_train.tasks.finetune.race import NUM_CHOICES
from megatron_train.tasks.finetune.samples import ChoiceRecord, PairRecord, TaskDataError, clean_text

# task -> (first text column, second text column, HF class name -> our label id)
PAIR_COLUMNS = {
    "MNLI": ("premise", "hypothesis", MNLI_LABELS),
    "QQP": ("question1", "question2", {"not_duplicate": 0, "duplicate": 1}),
}
RACE_COLUMNS = ("article", "question", "options", "answer")
DEFAULT_SPLITS = {  # task -> (train split, validation splits) of the hub dataset
    "MNLI": ("train", ("validation_matched", "validation_mismatched")),
    "QQP": ("train", ("validation",)),
    "RACE": ("train", ("validation",)),
}


def load_hf_splits(name: str, splits: list[str]):
    """{split: datasets.Dataset} from a `save_to_disk` folder or a cached hub dataset `path[/config]`."""
    import datasets  # slow to import: only when --hf-dataset is given

    if os.path.isdir(name):
        loaded = datasets.load_from_disk(name)
        if not isinstance(loaded, datasets.DatasetDict):
            raise TaskDataError(name, "dataset", "a single split; save a DatasetDict with named splits")
        missing = [split for split in splits if split not in loaded]
        if missing:
            raise TaskDataError(
                name, "dataset", f"no split {missing[0]!r} (it has {sorted(loaded)}); pass --hf-splits"
            )
        return {split: loaded[split] for split in splits}
    path, _, config = name.partition("/")
    return {split: datasets.load_dataset(path, config or None, split=split) for split in splits}


def _columns(dataset, source: str, columns: tuple[str, ...]) -> None:
    for column in columns:
        if column not in dataset.column_names:
            raise TaskDataError(source, "dataset", f"no column {column!r} (it has {dataset.column_names})")


def pair_records(task: str, dataset, source: str) -> list[PairRecord]:
    text_a, text_b, labels = PAIR_COLUMNS[task]
    _columns(dataset, source, (text_a, text_b, "label"))
    names = getattr(dataset.features["label"], "names", None)
    records = []
    for row, example in enumerate(dataset):
        label = example["label"]
        name = names[label] if names is not None and 0 <= label < len(names) else str(label)
        if name not in labels:
            raise TaskDataError(
                source, f"row {row}", f"field 'label' is {label!r} ({name}), not one of {sorted(labels)}"
            )
        for column in (text_a, text_b):
            if not str(example[column]).strip():
                raise TaskDataError(source, f"row {row}", f"field {column!r} is empty")
        records.append(
            PairRecord(
                example.get("idx", row),
                clean_text(example[text_a]),
                clean_text(example[text_b]),
                labels[name],
            )
        )
    return records


def race_records(dataset, source: str) -> list[ChoiceRecord]:
    _columns(dataset, source, RACE_COLUMNS)
    letters = [chr(ord("A") + i) for i in range(NUM_CHOICES)]
    records = []
    for row, example in enumerate(dataset):
        if len(example["options"]) != NUM_CHOICES:
            raise TaskDataError(source, f"row {row}", f"field 'options' must hold {NUM_CHOICES} options")
        if example["answer"] not in letters:
            raise TaskDataError(
                source, f"row {row}", f"field 'answer' is {example['answer']!r}, not one of {letters}"
            )
        records.append(
            ChoiceRecord(
                row,
                example["article"],
                example["question"],
                tuple(example["options"]),
                letters.index(example["answer"]),
            )
        )
    return records


def hf_records(task: str, name: str, splits: list[str]) -> dict[str, list[PairRecord | ChoiceRecord]]:
    """{split: records} of `task` from the Hugging Face dataset `name`."""
    loaded = load_hf_splits(name, splits)
    return {
        split: race_records(dataset, f"{name}[{split}]")
        if task == "RACE"
        else pair_records(task, dataset, f"{name}[{split}]")
        for split, dataset in loaded.items()
    }
