"""Shared fixtures for the fidelity tests: a private dbus-daemon and our binaries (found via BLEBRIDGE_BIN_DIR)."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bin_dir() -> pathlib.Path:
    env = os.environ.get("BLEBRIDGE_BIN_DIR")
    if env:
        return pathlib.Path(env)
    out = subprocess.run(["swift", "build", "--show-bin-path"], cwd=ROOT, capture_output=True, text=True, check=True)
    return pathlib.Path(out.stdout.strip())


@pytest.fixture(scope="session")
def binaries() -> pathlib.Path:
    return bin_dir()
