"""Work split into fixed ranges ("blocks"), each committed as one `.npy` file, so a killed run resumes.

A block file exists only once complete (written through `storage.atomic`), so the blocks still to do are
exactly the missing files. The directory also keeps the settings the blocks were built with
(`settings.json`): a rerun with other settings is refused instead of mixing old and new blocks.
See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import json
import os

import numpy as np

from storage.atomic import atomic_path, atomic_write_text

SETTINGS_FILE = "settings.json"


def block_ranges(total: int, block_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `block_size` covering 0..total (the last one shorter)."""
    return [(start, min(total, start + block_size)) for start in range(0, total, block_size)]


def block_path(directory: str, start: int, end: int) -> str:
    return os.path.join(directory, f"{start:010d}-{end:010d}.npy")


def missing_blocks(directory: str, total: int, block_size: int) -> list[tuple[int, int]]:
    """The ranges whose block file is not committed yet."""
    return [r for r in block_ranges(total, block_size) if not os.path.isfile(block_path(directory, *r))]


def save_block(path: str, array: np.ndarray) -> None:
    """Commit one block: the file appears complete or not at all."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)


def load_blocks(directory: str, total: int, block_size: int) -> list[np.ndarray]:
    """Every block of 0..total, in order; an error names the first missing file."""
    blocks = []
    for start, end in block_ranges(total, block_size):
        path = block_path(directory, start, end)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: block [{start}, {end}) is not built yet; rerun the build")
        blocks.append(np.load(path, allow_pickle=False))
    return blocks


def check_settings(directory: str, settings: dict) -> None:
    """Record `settings` in `directory`, or refuse if the blocks already there were built with others."""
    path = os.path.join(directory, SETTINGS_FILE)
    wanted = json.loads(json.dumps(settings, sort_keys=True))
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
        if found != wanted:
            changed = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
            raise ValueError(
                f"{path}: {directory} was built with other settings ({', '.join(changed)} differ: "
                f"{ {k: found.get(k) for k in changed} } there, { {k: wanted.get(k) for k in changed} } now); "
                "use a new directory or delete this one"
            )
        return
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(path, json.dumps(wanted, indent=2, sort_keys=True) + "\n")
