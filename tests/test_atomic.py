"""storage.atomic: the one temp-file-then-rename writer."""

from __future__ import annotations

import os

import pytest

from storage.atomic import atomic_copy, atomic_move, atomic_path, atomic_write_text, is_temporary


def test_write_replaces_whole_file(tmp_path):
    path = tmp_path / "a" / "f.txt"
    atomic_write_text(str(path), "one")
    atomic_write_text(str(path), "two")
    assert path.read_text() == "two"
    assert os.listdir(path.parent) == ["f.txt"]


def test_failed_write_leaves_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(str(path)) as tmp:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_temporary_names_are_recognised(tmp_path):
    with atomic_path(str(tmp_path / "model.safetensors")) as tmp:
        assert is_temporary(tmp)
        open(tmp, "w").close()
    assert not is_temporary(str(tmp_path / "model.safetensors"))
    assert not is_temporary("runs/x.tmp-dir/model.safetensors")  # only the base name counts


def test_copy_and_move(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"xyz")
    atomic_copy(str(src), str(tmp_path / "out" / "copy.bin"))
    assert (tmp_path / "out" / "copy.bin").read_bytes() == b"xyz"
    atomic_move(str(src), str(tmp_path / "moved" / "m.bin"))
    assert not src.exists() and (tmp_path / "moved" / "m.bin").read_bytes() == b"xyz"


def test_exclusive_write_keeps_the_first_file(tmp_path):
    path = tmp_path / "manifest.json"
    with atomic_path(str(path), exclusive=True) as tmp, open(tmp, "w") as f:
        f.write("first")
    with pytest.raises(FileExistsError), atomic_path(str(path), exclusive=True) as tmp, open(tmp, "w") as f:
        f.write("second")
    assert path.read_text() == "first" and os.listdir(tmp_path) == ["manifest.json"]
