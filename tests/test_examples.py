"""Every script in examples/ runs to completion (each in its own process, as a user runs
it). Marked `slow`: run by `nox -s slow`, beside the other whole fits, on the same
pytest-xdist workers."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parents[1] / "examples").glob("*.py"))

# the scripts turn float64 on themselves: run them in the float64 session only
pytestmark = [pytest.mark.slow, pytest.mark.x64_only]


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    # (the worker's environment: its XLA threads and its Numba cache, already warm)
    env = {**os.environ, "EQUILENS_EXAMPLE_OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stderr[-5000:]}"
    assert proc.stdout.strip(), f"{script.name} printed nothing"
    if "EQUILENS_EXAMPLE_OUT" in script.read_text():
        assert any(tmp_path.iterdir()), f"{script.name} wrote nothing"
