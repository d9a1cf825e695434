"""ds_ext/fileio.py, the one atomic write: the new file replaces the old one only when
the block ends without an error, no temporary file is left either way, the new file
has a plain open()'s permissions, and the fsyncs asked for happen before (file) and
after (directory) the rename. Single process, under a second."""

import os
import stat

import pytest

from ds_ext import fileio
from ds_ext.fileio import atomic_open, atomic_write


def test_replaces_on_success_and_leaves_only_the_file(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("old\n")
    with atomic_open(path, "w", newline="") as f:
        f.write("new\r\n")
        assert path.read_text() == "old\n"             # readers see the old file until the end
    assert path.read_bytes() == b"new\r\n"
    atomic_write(path, b"bytes")
    assert path.read_bytes() == b"bytes"
    atomic_write(str(path), "text\n")
    assert path.read_text() == "text\n"
    assert os.listdir(tmp_path) == ["metrics.csv"]


def test_an_error_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "latest"
    path.write_bytes(b"global_step4")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_open(path, "wb") as f:
            f.write(b"global_st")
            raise RuntimeError("disk on fire")
    assert path.read_bytes() == b"global_step4"
    with pytest.raises(RuntimeError):
        with atomic_open(tmp_path / "new", "w") as f:
            raise RuntimeError
    assert os.listdir(tmp_path) == ["latest"]


def test_permissions_are_those_of_open(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a", b"x")
        with open(tmp_path / "b", "wb"):
            pass
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o644


def test_fsyncs_as_asked(tmp_path, monkeypatch):
    events = []
    plain_fsync, plain_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"), plain_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("rename"), plain_replace(a, b))[1])
    atomic_write(tmp_path / "plain", b"x")
    assert events == ["rename"]
    events.clear()
    atomic_write(tmp_path / "contents", b"x", fsync=True)
    assert events == ["file", "rename"]
    events.clear()
    atomic_write(tmp_path / "durable", b"x", fsync=True, fsync_dir=True)
    assert events == ["file", "rename", "dir"]


def test_only_whole_file_modes(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        with atomic_open(tmp_path / "x", "a"):
            pass
    assert os.listdir(tmp_path) == []
    assert fileio.fsync_directory(tmp_path) is None
