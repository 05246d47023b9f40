"""nox sessions: lint, typecheck, tests (the fast suite, float64) and tests-float32, slow
(whole fits and the examples), crosscheck, examples, docs, bench.

`nox -s tests-3.11` runs the fast suite in float64 on Python 3.11 (jax <= 0.10.1),
`nox -s tests-float32-3.11` in float32; `nox -s tests-3.12` on Python 3.12 with the newest
jax. `nox -s slow` runs the tests marked `slow` (whole fits of real and simulated lenses)
and every script in examples/; `nox -s slow-ci` the ones of them marked `ci` (the demo and
the fit command); `nox -s numba-boundscheck` the Numba kernels' tests with bounds checking;
`nox -s sharding` the sharded == single-device checks on 1, 2 and 4 CPU devices (Python
3.11 and 3.12). `nox -s crosscheck-pyautolens` compares the pixelized evidence with
PyAutoLens's (Python 3.12). `.ci/run` runs the README's test command, then, while its time
allows, the float32 fast suite, the newest-jax fast suite, `slow-ci`, `sharding-3.11`,
`sharding-3.12`, `crosscheck-pyautolens` and `numba-boundscheck`."""

import os
import pathlib

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests-3.11", "crosscheck", "docs"]

PYTHONS = ["3.11", "3.12", "3.13"]
# Pinned dev tools.
RUFF = "ruff==0.14.5"
PYRIGHT = "pyright[nodejs]==1.1.407"
ROOT = pathlib.Path(__file__).parent
# pytest-xdist workers: one per core, at most two (the CI machine has two).
WORKERS = str(min(2, os.cpu_count() or 1))


#: Python's bytecode cache written, as Python does by default, where the environment turns it
#: off (PYTHONDONTWRITEBYTECODE; the CI machines set it): a session's pytest processes, its
#: xdist workers and the subprocesses its tests start each import jax, equinox, NumPy,
#: SciPy, Numba, matplotlib... and without cached bytecode each compiled those modules'
#: sources again: 11.7-14.9 s per process against 4.5-4.7 s (the fast suite's imports, on
#: the 2-core machine of 2026-11-29). uv installs without compiling bytecode.
_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}


def _jax_cache(python: str, precision: str) -> dict[str, str]:
    """JAX's persistent compilation cache, shared by the processes of one Python and
    precision (pytest-xdist workers, the slow tests and the examples compile many of the
    same programs). Its keys hold the program, the jax version and the compile options, so
    a stale entry is never used. Programs with host callbacks are not cached. (jax 0.10.1
    writes an entry in place, not atomically, when the cache has no size limit.)"""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".jax-cache" / f"py{python}-{precision}"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1",
    }


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install(RUFF)
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """pyright on src/, with the optional dependencies the code imports (the samplers',
    pyHalo)."""
    session.install("-e", ".[numba,sampling,substructure,cluster]", PYRIGHT)
    session.run("pyright", "src")


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The fast suite (everything not marked `slow` or `sharding`) in float64, with
    jaxtyping + beartype runtime checks. Installs the sampling extra (blackjax, nautilus,
    arviz) for the samplers' tests."""
    session.install("-e", ".[test,sampling]")
    _pytest(session, "not slow and not sharding", str(session.python), "float64")


@nox.session(python=PYTHONS, name="tests-float32")
def tests_float32(session: nox.Session) -> None:
    """The fast suite in float32 (x64 off), without the tests marked `x64_only` or
    `precision_independent`. Run by `.ci/run` right after the README's test command (out
    of that command since 2026-12-04: both precisions took it over its 12 minutes on the
    2-core machine)."""
    session.install("-e", ".[test,sampling]")
    _pytest(session, "not slow and not sharding", str(session.python), "float32")


@nox.session(python=["3.11", "3.12"])
def sharding(session: nox.Session) -> None:
    """The sharded == single-device checks (tests/test_sharding.py): every term's value and
    gradient, fits and batches, on meshes of 1, 2 and 4 of the 4 CPU devices that
    tests/conftest.py creates (XLA_FLAGS=--xla_force_host_platform_device_count=4), float64,
    and the two-process `jax.distributed` check. On Python 3.11 (jaxlib 0.10, whose batched
    CPU LAPACK kernels deadlock on several devices: fit_batch's one-element-per-device
    route) and 3.12 (the newest jax: several elements per device)."""
    session.install("-e", ".[test,sampling]")
    _pytest(session, "sharding", str(session.python), "float64")


@nox.session(python="3.11", name="slow-ci")
def slow_ci(session: nox.Session) -> None:
    """The slow tests that `.ci/run` runs (marked `ci`): the demo fit of the HST lens (the
    README's main job) and the `equilens fit` command end to end. Every other slow test
    runs with `nox -s slow` (about 2 hours on the 2-core CI machine of 2026-11)."""
    session.install("-e", ".[test,crosscheck,sampling,cluster]")
    _pytest(session, "slow and ci", "3.11", "float64", whole_fits=True)


@nox.session(python="3.11")
def slow(session: nox.Session) -> None:
    """The tests marked `slow` (float64): whole fits (the HST demo, the CLI, recovery over
    seeds and solvers, evidence fits) and every script in examples/ (tests/test_examples.py
    runs each in its own process), shared out over the pytest-xdist workers. Installs
    lenstronomy (one lens of the lenstronomy-simulated validation suite is fitted end to
    end) and the sampling extra (the samplers' lens-sized tests, the nested-sampling and
    model-comparison examples) and the substructure extra (the population example)."""
    session.install("-e", ".[test,crosscheck,sampling,substructure,cluster]")
    _pytest(session, "slow", "3.11", "float64", whole_fits=True)


def _pytest(
    session: nox.Session, marker: str, python: str, precision: str, whole_fits: bool = False
) -> None:
    """pytest on the xdist workers: the tests selected by `marker`, in `precision`;
    `whole_fits` for the slow tests (compiled as users compile, sharing a bounded cache)."""
    env = {"EQUILENS_TEST_X64": "1" if precision == "float64" else "0"} | _BYTECODE
    # (the fast suite compiles at XLA's optimisation level 0: see tests/conftest.py)
    env["EQUILENS_TEST_FAST_COMPILE"] = "0" if whole_fits else "1"
    if not whole_fits:
        env |= _jax_cache(python, precision)
    else:
        # The slow tests share compiled programs through equilens's own bounded cache
        # (4 GiB, least recently used evicted): the command-line tests fit the same data
        # with the same options, and every slow test frees its in-memory programs when it
        # ends (tests/conftest.py). Its own folder: these compile at XLA's default level.
        env["EQUILENS_COMPILATION_CACHE"] = str(ROOT / ".jax-cache" / f"py{python}-slow")
    # the lenstronomy and PyAutoLens comparisons run in the crosscheck sessions, which
    # install them. `--dist worksteal`: each worker starts on half of the tests in file
    # order and takes from the other's queue when its own runs out, so a file's tests mostly
    # share one worker's compiled programs and eager operations (the float64 fast suite
    # 549.8-550.8 -> 508.8 s, CPU 16.7 -> 15.5 min, clean clones, empty caches, 2026-11-29)
    # while the end stays balanced (`loadfile` leaves the largest file as the tail).
    session.run(
        "pytest",
        "-n",
        WORKERS,
        "--dist",
        "worksteal",
        "-m",
        marker,
        "--ignore=tests/test_crosscheck.py",
        "--ignore=tests/test_crosscheck_pyautolens.py",
        "-q",
        "--durations=15",
        # a hung test fails with every thread's stack after this long (pytest-timeout),
        # where it would otherwise hold the run until CI's own limit (the slowest test of
        # slow-ci took 141 s, of the fast suite 18 s, on the 2-core machine of 2026-12-02)
        f"--timeout={1800 if marker == 'slow' else 900 if whole_fits else 300}",
        *session.posargs,
        env=env,
    )


@nox.session(python="3.11", name="numba-boundscheck")
def numba_boundscheck(session: nox.Session) -> None:
    """The Numba kernels' tests (the backend's parity suite, the host linear algebra) with
    Numba's bounds checking on: an index out of range raises instead of reading memory.
    One process, with its own kernel cache (bounds-checked code is compiled apart)."""
    session.install("-e", ".[test]")
    env = {
        "EQUILENS_TEST_X64": "1",
        "NUMBA_BOUNDSCHECK": "1",
        "NUMBA_CACHE_DIR": str(ROOT / ".numba-cache" / "boundscheck"),
    }
    session.run(
        "pytest", "-n", "0", "-q", "tests/test_numba.py", "tests/test_host_linalg.py", env=env
    )


@nox.session(python="3.11")
def crosscheck(session: nox.Session) -> None:
    """Agreement with lenstronomy over random parameter draws (prints the worst errors)."""
    session.install("-e", ".[test,crosscheck,substructure]")
    # the whole fits of lenstronomy-simulated lenses are `slow` too: the slow session runs them
    session.run(
        "pytest",
        "-m",
        "crosscheck and not slow",
        "--ignore=tests/test_crosscheck_pyautolens.py",
        "-q",
        "-s",
        "-n",
        "0",
        *session.posargs,
    )


@nox.session(python="3.12", name="crosscheck-pyautolens")
def crosscheck_pyautolens(session: nox.Session) -> None:
    """The pixelized evidence against PyAutoLens (Python >= 3.12) on identical inputs, term
    by term, with PyAutoLens's definitions chosen (prints every term and its error)."""
    session.install("-e", ".[test,pyautolens]")
    session.run(
        "pytest",
        "-q",
        "-s",
        "-n",
        "0",
        "tests/test_crosscheck_pyautolens.py",
        *session.posargs,
        env={"EQUILENS_TEST_X64": "1"},
    )


@nox.session(python="3.11")
def examples(session: nox.Session) -> None:
    """Runs every script in examples/, one after another (small data; `slow` runs them too,
    as tests)."""
    session.install("-e", ".[sampling]")
    env = _jax_cache("3.11", "float64")
    for script in sorted(pathlib.Path("examples").glob("*.py")):
        session.run(
            "python", str(script), env={**env, "EQUILENS_EXAMPLE_OUT": session.create_tmp()}
        )


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
        "benchmarks/bench_step.py",
        "benchmarks/bench_pixelized.py",
        "benchmarks/bench_mesh.py",
        "benchmarks/bench_regularization.py",
        "benchmarks/bench_numba.py",
        "benchmarks/bench_multiband.py",
        "benchmarks/bench_sharding.py",
        "benchmarks/bench_sampling.py",
        "benchmarks/bench_multiplane.py",
        "benchmarks/bench_subhalo.py",
    ):
        session.run("python", script, *session.posargs)
