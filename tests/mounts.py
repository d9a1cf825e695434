"""A small filesystem that fills up: a tmpfs of a few MB mounted for one test."""

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(path, *, mb=3):
    """Mount a ``mb`` MB tmpfs at ``path`` (made here) for the ``with`` block; the test is
    skipped where mounting needs root it does not have."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
