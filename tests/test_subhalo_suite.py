"""The subhalo suite's bookkeeping (`validation/subhalo_suite.py`): a suite that takes
longer than one sitting is one measurement only if every row comes from the same code, so
each row records the version of `src/` and a folder refuses rows of another."""

import importlib.util
import json
import pathlib
import sys

import pytest

SUITE = pathlib.Path(__file__).parents[1] / "validation" / "subhalo_suite.py"


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, str(SUITE.parent))  # (it imports realistic_suite beside it)
    try:
        spec = importlib.util.spec_from_file_location("subhalo_suite", SUITE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SUITE.parent))
    return module


def test_rows_of_another_version_are_found(suite):
    version = {"src_commit": "abc1234", "src_dirty": False}
    rows = [
        {"lens": 0, "which": "null", "src_commit": "abc1234", "src_dirty": False},
        {"lens": 0, "which": "injected", "src_commit": "abc1234", "src_dirty": True},
        {"lens": 1, "which": "null", "src_commit": "0ff1ce0", "src_dirty": False},
        {"lens": 1, "which": "injected"},  # (written before rows recorded a version)
    ]
    assert [(r["lens"], r["which"]) for r in suite.other_versions(rows, version)] == [
        (0, "injected"),
        (1, "null"),
        (1, "injected"),
    ]
    assert suite.version_label(rows[1]) == "abc1234+"
    assert suite.version_label(rows[3]) == "None"


def test_a_folder_of_another_version_is_refused(suite, tmp_path, monkeypatch, capsys):
    here = SUITE.parents[1] / "src" / "equilens"
    monkeypatch.setattr(suite, "imported_equilens", lambda: str(here))
    monkeypatch.setattr(
        suite, "code_version", lambda: {"src_commit": "abc1234", "src_dirty": False}
    )

    # the bookkeeping is checked before anything is simulated: a call that got past it
    # would stop here
    def no_simulation():
        raise AssertionError("simulated past the version check")

    monkeypatch.setattr(suite, "hdf_galaxies", no_simulation)
    row = {"lens": 0, "which": "null", "exit": 0, "src_commit": "0ff1ce0", "src_dirty": False}
    (tmp_path / "rows.json").write_text(json.dumps([row]))
    assert suite.main(["--output", str(tmp_path), "--lenses", "0"]) == 2
    err = capsys.readouterr().err
    assert "0ff1ce0" in err and "abc1234" in err
    # and it goes on with --allow-mixed (here, to the simulation)
    with pytest.raises(AssertionError, match="simulated past"):
        suite.main(["--output", str(tmp_path), "--lenses", "0", "--allow-mixed"])


def test_scans_that_would_run_other_code_are_refused(suite, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "imported_equilens", lambda: "/elsewhere/site-packages/equilens")
    assert suite.main(["--output", str(tmp_path), "--lenses", "0"]) == 2
    assert "/elsewhere" in capsys.readouterr().err


def test_the_version_is_the_last_commit_that_changed_src(suite):
    import subprocess

    done = subprocess.run(
        ["git", "-C", str(SUITE.parents[1]), "log", "-1", "--format=%h", "--", "src"],
        capture_output=True,
        text=True,
    )
    version = suite.code_version()
    if done.returncode != 0:  # not a git checkout: no version to record
        assert version == {"src_commit": None, "src_dirty": None}
        return
    assert version["src_commit"] == done.stdout.strip()
    assert isinstance(version["src_dirty"], bool)
