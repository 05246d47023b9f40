"""nox sessions: lint, typecheck, tests (python x precision matrix), crosscheck, examples,
docs, bench. `nox -s tests-3.11` runs the float64 and float32 variants on Python 3.11."""

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests-3.11", "crosscheck", "examples", "docs"]

PYTHONS = ["3.11", "3.12", "3.13"]
# Pinned dev tools.
RUFF = "ruff==0.14.5"
PYRIGHT = "pyright[nodejs]==1.1.407"


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install(RUFF)
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".", PYRIGHT)
    session.run("pyright", "src")


@nox.session(python=PYTHONS)
@nox.parametrize("precision", ["float64", "float32"])
def tests(session: nox.Session, precision: str) -> None:
    """The test suite with jaxtyping + beartype runtime checks; float32 runs with x64 off."""
    session.install("-e", ".[test]")
    env = {"EQUILENS_TEST_X64": "1" if precision == "float64" else "0"}
    # the lenstronomy comparisons run in the crosscheck session, which installs lenstronomy
    session.run(
        "pytest", "-n", "2", "--ignore=tests/test_crosscheck.py", "-q", *session.posargs, env=env
    )


@nox.session(python="3.11")
def crosscheck(session: nox.Session) -> None:
    """Agreement with lenstronomy over random parameter draws (prints the worst errors)."""
    session.install("-e", ".[test,crosscheck]")
    session.run("pytest", "-m", "crosscheck", "-q", "-s", "-n", "0", *session.posargs)


@nox.session(python="3.11")
def examples(session: nox.Session) -> None:
    """Runs every script in examples/ (small data)."""
    import pathlib

    session.install("-e", ".")
    for script in sorted(pathlib.Path("examples").glob("*.py")):
        session.run("python", str(script), env={"EQUILENS_EXAMPLE_OUT": session.create_tmp()})


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks: prints equilens and lenstronomy timings and their ratios."""
    session.install("-e", ".[bench]")
    for script in (
        "benchmarks/bench_forward.py",
        "benchmarks/bench_fit.py",
        "benchmarks/bench_pixelized.py",
    ):
        session.run("python", script, *session.posargs)
