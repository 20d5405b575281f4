"""Where the converter writes: a folder that holds another run's checkpoints or another model's files is refused
unless --overwrite, which replaces it whole; a failed write (full disk, read-only target) leaves nothing behind and
ends in one line; the flags that size the output are refused at zero."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from megatron_train.convert import ModelWeights, flow
from megatron_train.convert.weights import trim_vocab
from megatron_train.tools.checkpoint_util import main
from tests.helpers.convert_models import VOCAB, our_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny Llama checkpoint of ours (the source of every conversion here)."""
    root = tmp_path_factory.mktemp("source")
    config, model = our_llama(untied=True)
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB)), str(root / "run"))
    return str(root / "run")


def _convert(capsys, *argv: str) -> str:
    """The converter's one-line error (its exit is 2) without argparse's program name, or "" when it succeeded."""
    try:
        main(["--model-type", "GPT", *argv])
    except SystemExit as exit_:
        assert exit_.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1]
    capsys.readouterr()
    return ""


def _tree(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder)
                  for name in names)  # fmt: skip


def _training_run(folder) -> None:
    """What a training run leaves: two iterations and the marker naming the later one."""
    for iteration in (2, 4):
        os.makedirs(folder / f"iter_{iteration:07d}" / "mp_rank_00")
        (folder / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    (folder / "latest_checkpointed_iteration.txt").write_text("4")


def test_converting_into_a_training_run_is_refused_and_overwrite_replaces_it_whole(
    checkpoint, tmp_path, capsys
):
    hf = tmp_path / "hf"
    assert _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(hf)) == ""
    run = tmp_path / "run"
    _training_run(run)
    before = _tree(run)
    error = _convert(
        capsys, "--loader", "hf", "--saver", "flow", "--load-dir", str(hf), "--save-dir", str(run)
    )
    assert error == (
        f"--save-dir {run} already holds a run's checkpoints (iter_0000002, "
        "iter_0000004, latest_checkpointed_iteration.txt): writing into it would mix them with the converted model; "
        "pick a new or empty --save-dir, or pass --overwrite to replace the folder whole"
    )
    assert _tree(run) == before and (run / "latest_checkpointed_iteration.txt").read_text() == "4"
    for saver in ("megatron", "torch_dist"):  # every saver refuses the same way
        error = _convert(capsys, "--saver", saver, "--load-dir", checkpoint, "--save-dir", str(run))
        assert f"--save-dir {run} already holds a run's checkpoints" in error
    error = _convert(capsys, "--load-dir", checkpoint, "--save-dir", str(run))  # flow -> flow resharding
    assert f"--save-dir {run} already holds a run's checkpoints" in error
    assert _tree(run) == before

    assert (
        _convert(capsys, "--loader", "hf", "--load-dir", str(hf), "--save-dir", str(run), "--overwrite") == ""
    )
    assert not any(name.startswith(("iter_0000002", "iter_0000004")) for name in _tree(run))
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]  # the old folder is gone too


def test_hf_saver_into_another_models_folder_is_refused_and_overwrite_leaves_no_stale_shard(
    checkpoint, tmp_path, capsys
):
    out = tmp_path / "hf"
    assert _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(out),
                    "--max-shard-size", "60000") == ""  # fmt: skip
    shards = sorted(name for name in os.listdir(out) if name.startswith("model-"))
    assert len(shards) == 3, shards
    error = _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(out))
    assert error == (
        f"--save-dir {out} already holds a model's files (config.json, model-00001-of-00003.safetensors, "
        "model-00002-of-00003.safetensors, model-00003-of-00003.safetensors, model.safetensors.index.json): writing "
        "into it would mix them with the converted model; pick a new or empty --save-dir, or pass --overwrite to "
        "replace the folder whole"
    )
    assert (
        _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(out), "--overwrite")
        == ""
    )
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_an_empty_or_symlinked_target_is_written_and_a_file_or_mount_point_refused(
    checkpoint, tmp_path, capsys, monkeypatch
):
    (tmp_path / "empty").mkdir()
    assert (
        _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(tmp_path / "empty"))
        == ""
    )
    assert "model.safetensors" in os.listdir(tmp_path / "empty")
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert (
        _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(tmp_path / "link"))
        == ""
    )
    assert os.path.islink(tmp_path / "link") and "model.safetensors" in os.listdir(tmp_path / "real")
    (tmp_path / "file").write_text("x")
    error = _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(tmp_path / "file"))
    assert error.endswith(
        f"--save-dir {tmp_path / 'file'} is a file: pass a folder to write the converted model to"
    )
    mount = tmp_path / "mnt"
    mount.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: str(path) == str(mount))
    error = _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(mount))
    assert error.endswith(
        f"--save-dir {mount} is a mount point: the output is built beside the folder and renamed into place, which "
        f"a mount point cannot be; pass a folder inside it (--save-dir {mount}/model)"
    )


def test_a_read_only_target_is_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys, monkeypatch):
    """The tests run as root, which ignores permission bits: the file system's refusal is what mkdir raises."""
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    out = tmp_path / "out"
    error = _convert(capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(out))
    assert re.fullmatch(
        re.escape(f"--save-dir {out}: cannot write the converted model: Read-only file "
                  "system (") + r"[0-9.]+ MB free there\); nothing was written\. Free space, make the folder writable, "
        r"or pick another --save-dir",
        error,
    ), error  # fmt: skip
    assert os.listdir(tmp_path) == []


FULL_DISK = textwrap.dedent(
    """
    import contextlib, io, json, resource, signal, sys
    from megatron_train.tools.checkpoint_util import main

    source, root = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # the disk fills after 20 kB of any file
    results = {}
    for saver in ("flow", "hf", "megatron", "torch_dist"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                main(["--saver", saver, "--load-dir", source, "--save-dir", f"{root}/{saver}"])
                code = 0
            except SystemExit as exit_:
                code = exit_.code
        results[saver] = (code, err.getvalue().strip().splitlines()[-1:])
    print(json.dumps(results))
    """
)


@pytest.mark.processes
def test_a_full_disk_is_one_line_per_saver_and_leaves_no_partial_file(checkpoint, tmp_path):
    """RLIMIT_FSIZE in a subprocess makes every writer (safetensors, torch.save, DCP) fail the way a full disk does;
    before, the hf and flow savers raised a raw SafetensorError and torch_dist left a partial __0_0.distcp."""
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, checkpoint, str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    files = {
        "flow": "iter_0000001/mp_rank_00/model.safetensors",
        "hf": "model.safetensors",
        "megatron": "iter_0000001/mp_rank_00/model_optim_rng.pt",
        "torch_dist": "iter_0000001/__0_0.distcp",
    }
    reasons = {"megatron": "torch.save stopped writing it"}  # torch's zip writer gives no errno
    for saver, (code, lines) in results.items():
        assert code == 2, (saver, lines)
        save_dir = out / saver
        assert re.fullmatch(
            re.escape(f"-c: error: --save-dir {save_dir}: cannot write {save_dir}/{files[saver]}: "
                      f"{reasons.get(saver, 'File too large')} (") + r"[0-9.]+ MB free there\); nothing was written\. "
            r"Free space, make the folder writable, or pick another --save-dir",
            lines[0],
        ), (saver, lines)  # fmt: skip
    assert os.listdir(out) == []  # no saver's folder, no temporary folder beside it


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--true-vocab-size", "0"), ("--target-tensor-parallel-size", "0"), ("--target-pipeline-parallel-size", "-1"),
     ("--max-shard-size", "0"), ("--iteration", "-2"), ("--true-vocab-size", "ten")],
)  # fmt: skip
def test_sizes_of_zero_are_refused_by_the_flag(checkpoint, tmp_path, capsys, flag, value):
    """Before, --true-vocab-size 0 wrote a [0, h] embedding and a TP size of 0 meant "the checkpoint's"."""
    error = _convert(
        capsys, "--saver", "hf", "--load-dir", checkpoint, "--save-dir", str(tmp_path / "o"), flag, value
    )
    expected = f"must be at least {1 if flag != '--iteration' else 0}, got {value}" if value != "ten" else (
        "'ten' is not an integer"
    )  # fmt: skip
    assert error == f"argument {flag}: {expected}"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("saver", "ckpt_format"), [("megatron", "torch"), ("torch_dist", "torch_dist")])
def test_the_printed_megatron_command_names_a_ckpt_format_megatron_lm_has(checkpoint, tmp_path, capsys, saver,
                                                                         ckpt_format):  # fmt: skip
    main(["--saver", saver, "--load-dir", checkpoint, "--save-dir", str(tmp_path / saver)])
    printed = capsys.readouterr().out
    assert f"--load {tmp_path / saver} --ckpt-format {ckpt_format} --use-checkpoint-args" in printed
    assert "--ckpt-format megatron" not in printed
