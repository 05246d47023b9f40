"""Compiled programs kept on disk: JAX's persistent compilation cache, on by default.

A lens fit compiles programs that take seconds each (a fit's solver loop, the covariance, a
search's screening batch). JAX can keep compiled programs on disk, keyed by the program,
the jax and jaxlib versions, the device and the compile options, so that a second run of
the same problem (another process, another day) loads them instead of compiling: a stale
entry is never used. `import equilens` turns this cache on in the user's cache folder
(`default_cache_dir()`), unless

- the user has configured JAX's cache themselves (`jax_compilation_cache_dir` set, by
  `jax.config.update` before the import or the `JAX_COMPILATION_CACHE_DIR` environment
  variable): theirs is kept as it is;
- the environment variable `EQUILENS_COMPILATION_CACHE` is `0` (or `off`, `false`, `no`):
  nothing is changed; any other value names the folder to use.

`compilation_cache(path)` turns it on (or off, with `None`) at run time. Programs holding
host callbacks (a fit's progress bar, the Numba backend's routes called from JAX) are
compiled every time: JAX does not store them. Numba keeps its own kernels on disk
(`cache=True`, in `__pycache__` folders or `NUMBA_CACHE_DIR`).

The cache is bounded (`MAX_SIZE` bytes, least recently used entries evicted first) and
locked between processes (the `filelock` package), so parallel test workers or several
`equilens` commands share one folder safely.
"""

import os
import pathlib
import sys

import jax

#: Environment variable: `0` / `off` / `false` / `no` leaves JAX's cache untouched; any
#: other value is the folder `import equilens` uses.
ENV = "EQUILENS_COMPILATION_CACHE"
#: The most bytes the cache folder holds (least recently used entries evicted first).
MAX_SIZE = 4 * 2**30
#: Programs that compile faster than this (seconds) are not stored. None is too small to
#: keep: the demo's 338 programs under 0.5 s took 41 s to compile in a warm run, and 0.02 s
#: each to load (all 352 programs loaded in 8 s).
MIN_COMPILE_TIME = 0.0

_OFF = ("0", "off", "false", "no")


def default_cache_dir() -> pathlib.Path:
    """The folder `import equilens` keeps compiled programs in: `equilens/jax` under the
    user's cache folder (`$XDG_CACHE_HOME`, else `~/.cache` on Linux; `~/Library/Caches`
    on macOS; `%LOCALAPPDATA%` on Windows)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or pathlib.Path.home() / "AppData" / "Local"
    elif sys.platform == "darwin":
        base = pathlib.Path.home() / "Library" / "Caches"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "equilens" / "jax"


def compilation_cache(
    path: str | os.PathLike[str] | None = "default",
    *,
    max_size: int = MAX_SIZE,
    min_compile_time: float = MIN_COMPILE_TIME,
) -> pathlib.Path | None:
    """Keeps JAX's compiled programs in `path` (default `default_cache_dir()`), bounded to
    `max_size` bytes, for programs that took at least `min_compile_time` seconds to
    compile; `path=None` turns the persistent cache off for the rest of the process.
    Returns the folder in use (None when off). This sets JAX's global configuration
    (`jax_compilation_cache_dir` and its companions): it applies to every program the
    process compiles from then on, equilens's or not.

    Raises `ValueError` for a negative size or time, and `OSError` when the folder
    cannot be created."""
    from jax._src import compilation_cache as cc

    if not (max_size > 0 or max_size == -1):
        raise ValueError(f"max_size must be > 0 bytes (or -1: no limit), got {max_size}")
    if not min_compile_time >= 0:
        raise ValueError(f"min_compile_time must be >= 0 seconds, got {min_compile_time}")
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        cc.reset_cache()
        return None
    folder = default_cache_dir() if path == "default" else pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_compilation_cache_max_size", int(max_size))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # the cache is opened on first use: a folder changed later in the process is taken up
    cc.reset_cache()
    return folder


def _configure_on_import() -> None:
    """What `import equilens` does: the cache on in `default_cache_dir()` unless the user
    chose otherwise (module docstring)."""
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in _OFF:
        return
    if jax.config.jax_compilation_cache_dir:  # pyright: ignore[reportAttributeAccessIssue]
        return  # the user's own cache (JAX_COMPILATION_CACHE_DIR or jax.config)
    try:
        compilation_cache(choice or "default")
    except OSError:
        # a read-only home: run without the cache rather than fail to import
        return
