"""Checks on the repository's contract files (the two commands, CI entry point)."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci/run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "scripts/test.sh" in ci
    assert "./scripts/test.sh" in readme
    assert "./scripts/demo.sh" in readme
