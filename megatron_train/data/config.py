"""Megatron's data flags (`--data-path`, `--split`, `--data-cache-path`, ...) as one typed config.

Also the parsers of the two flag forms whose syntax needs checking: the blend
(`prefix` or `w1 p1 w2 p2 ...`) and the split (`969,30,1`), with errors that name the bad token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their weights (None: weigh each dataset by its size, as Megatron does)."""

    prefixes: list[str]
    weights: list[float] | None


def _as_weight(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def parse_blend(tokens: list[str], flag: str = "--data-path") -> Blend:
    """Megatron's `get_blend_from_list`: `prefix [prefix ...]` or `weight prefix [weight prefix ...]`.

    Tokens may also arrive as one space-separated string (e.g. from a YAML config).
    """
    words = [word for token in tokens for word in str(token).split()]
    if not words:
        raise ValueError(f"{flag} is empty: give a dataset prefix, or pairs `weight prefix`")
    weights = [_as_weight(word) for word in words[0::2]]
    if len(words) % 2 or all(weight is None for weight in weights):
        numeric = [word for word in words if _as_weight(word) is not None]
        if numeric:
            raise ValueError(
                f"{flag} {' '.join(words)}: token {numeric[0]!r} looks like a weight, but the list is "
                "not `weight prefix` pairs; give every dataset a weight, or none"
            )
        return Blend(prefixes=words, weights=None)
    for position, (word, weight) in enumerate(zip(words[0::2], weights, strict=True)):
        if weight is None:
            raise ValueError(
                f"{flag} {' '.join(words)}: token {word!r} at position {2 * position + 1} should be the "
                "weight of the prefix after it; give every dataset a weight, or none"
            )
        if weight < 0:
            raise ValueError(f"{flag}: weight {word} of {words[2 * position + 1]!r} is negative")
    if sum(weights) <= 0:
        raise ValueError(
            f"{flag} {' '.join(words)}: the weights sum to 0; give at least one a positive weight"
        )
    return Blend(prefixes=words[1::2], weights=weights)


def parse_split(split: str) -> list[float]:
    """`969,30,1` (or `969/30/1`) as normalised train/valid/test fractions; missing entries are 0.

    Quotes around the value are ignored: Megatron's Llama-3 example passes `'99,1,0'` with the quotes (its
    parser keeps only the numbers)."""
    tokens = [token.strip() for token in split.strip("'\"").replace("/", ",").split(",")]
    if len(tokens) > len(SPLIT_NAMES):
        raise ValueError(f"--split {split!r}: at most 3 comma-separated weights (train,valid,test)")
    values = []
    for name, token in zip(SPLIT_NAMES, tokens, strict=False):
        value = _as_weight(token)
        if value is None or value < 0:
            raise ValueError(f"--split {split!r}: the {name} weight {token!r} is not a non-negative number")
        values.append(value)
    values += [0.0] * (len(SPLIT_NAMES) - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the weights sum to 0")
    return [value / total for value in values]


def split_matrix(fractions: list[float]) -> list[tuple[float, float] | None]:
    """Megatron's `convert_split_vector_to_split_matrix`: [0.9, 0.1, 0] -> [(0, 0.9), (0.9, 1.0), None]."""
    bookends: list[tuple[float, float] | None] = []
    begin = 0.0
    for fraction in fractions:
        end = begin + fraction
        bookends.append((begin, end) if end > begin else None)
        begin = end
    return bookends


def split_bounds(bookend: tuple[float, float], num_elements: int) -> tuple[int, int]:
    """The [begin, end) element range of one split, rounded as Megatron rounds it."""
    return int(round(bookend[0] * float(num_elements))), int(round(bookend[1] * float(num_elements)))


@dataclass
class DataConfig:
    """Where the pretraining tokens come from and how samples are cut from them."""

    data_path: list[str] | None = field(
        default=None,
        metadata={
            "help": "Dataset prefix(es) (`<prefix>.bin/.idx`): `prefix` or `w1 prefix1 w2 prefix2 ...`; "
            "split into train/valid/test by --split."
        },
    )
    split: str = field(
        default="969,30,1",
        metadata={"help": "Train,valid,test weights of each --data-path dataset's sequences, e.g. 969,30,1."},
    )
    train_data_path: list[str] | None = field(
        default=None, metadata={"help": "Train blend, instead of --data-path and --split."}
    )
    valid_data_path: list[str] | None = field(
        default=None, metadata={"help": "Validation blend, instead of --data-path and --split."}
    )
    test_data_path: list[str] | None = field(
        default=None, metadata={"help": "Test blend, instead of --data-path and --split."}
    )
    data_cache_path: str | None = field(
        default=None,
        metadata={
            "help": "Directory for the cached sample indices; default: a cache/ directory next to the "
            "data (a temporary directory when that is not writable)."
        },
    )
    mock_data: bool = field(
        default=False, metadata={"help": "Train on deterministic synthetic tokens instead of --data-path."}
    )
    num_workers: int = field(
        default=2, metadata={"help": "Dataloader worker processes (0: load in-process)."}
    )
    reset_position_ids: bool = field(
        default=False, metadata={"help": "Restart position ids at 0 after every end-of-document token."}
    )
    reset_attention_mask: bool = field(
        default=False,
        metadata={
            "help": "Block attention across end-of-document tokens: a token attends only to the earlier tokens "
            "of its own document (the end-of-document token belongs to the document it ends)."
        },
    )
    eod_mask_loss: bool = field(
        default=False, metadata={"help": "Exclude end-of-document tokens from the loss."}
    )

    sft: bool = field(
        default=False,
        metadata={
            "help": "Supervised finetuning (Megatron's flag): the data paths are JSONL files of "
            '{"messages": [{"role", "content"}, ...]} conversations; the loss covers the assistant\'s tokens only.'
        },
    )
    sft_tokenizer_prompt_format: Literal["chat-template", "chatml"] = field(
        default="chat-template",
        metadata={
            "help": "--sft: render conversations with the tokenizer's chat template (ChatML when it has none), "
            "or always with ChatML."
        },
    )
    sft_pack: bool = field(
        default=False,
        metadata={"help": "--sft: pack consecutive conversations into one sample instead of padding each."},
    )

    mask_prob: float = field(
        default=0.15, metadata={"help": "BERT/T5: probability of replacing a token with a mask."}
    )
    short_seq_prob: float = field(
        default=0.1, metadata={"help": "BERT/T5: probability of a sample shorter than --seq-length."}
    )

    def __post_init__(self) -> None:
        if self.sft_pack and not self.sft:
            raise ValueError("--sft-pack packs SFT conversations: it needs --sft")
        if self.sft and self.mock_data:
            raise ValueError("--sft reads JSONL conversations from the data paths: drop --mock-data")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        per_split = [self.train_data_path, self.valid_data_path, self.test_data_path]
        if self.data_path and any(per_split):
            raise ValueError(
                "--data-path cannot be combined with --train-data-path/--valid-data-path/--test-data-path; "
                "use one form"
            )
        self.blends()  # parse now, so a bad flag fails at start-up rather than at the first batch
        parse_split(self.split)

    def blends(self) -> list[Blend | None]:
        """The blend of each split: the same one three times for --data-path, else one per split flag."""
        if self.data_path:
            blend = parse_blend(self.data_path)
            return [blend, blend, blend]
        flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return [parse_blend(path, flag) if path else None for flag, path in zip(flags, paths, strict=True)]
