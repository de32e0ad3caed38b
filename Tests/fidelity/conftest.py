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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the end of the log of every bridge it started (Tests/fidelity/bridge_fixtures.py), so
    that a rare failure in CI can be told from its report alone."""
    outcome = yield
    report = outcome.get_result()
    try:
        from bridge_fixtures import BridgeProcess
    except ImportError:
        return
    if report.failed:
        for index, bridge in enumerate(BridgeProcess.started):
            try:
                text = bridge.log()
            except OSError as error:
                text = f"(log unreadable: {error})"
            report.sections.append((f"blebridge #{index + 1} log (last 6000 characters)", text[-6000:]))
    if report.when == "teardown":
        BridgeProcess.started.clear()
