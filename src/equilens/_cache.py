"""Compiled programs kept on disk: JAX's persistent compilation cache, on by default.

A lens fit compiles programs that take seconds each (a fit's solver loop, the covariance, a
search's screening batch). JAX can keep compiled programs on disk, keyed by the program,
the jax and jaxlib versions, the device and the compile options, so that a second run of
the same problem (another process, another day) loads them instead of compiling: a stale
entry is never used. `import equilens` turns this cache on in the user's cache folder
(`default_cache_dir()`), unless

- the user has configured JAX's cache themselves (`jax_compilation_cache_dir` set, by
  `jax.config.update` before the import or the `JAX_COMPILATION_CACHE_DIR` environment
  variable): theirs is kept as it is (its folder and settings; its reads lose jaxlib's
  tuning-preference lines, below);
- the environment variable `EQUILENS_COMPILATION_CACHE` is `0` (or `off`, `false`, `no`):
  nothing is changed; any other value names the folder to use.

`compilation_cache(path)` turns it on (or off, with `None`) at run time. Programs holding
host callbacks (a fit's progress bar, the Numba backend's routes called from JAX) are
compiled every time: JAX does not store them. Numba keeps its own kernels on disk
(`cache=True`, in `__pycache__` folders or `NUMBA_CACHE_DIR`).

The cache is bounded (`MAX_SIZE` bytes, least recently used entries evicted first) and
locked between processes (the `filelock` package), so parallel test workers or several
`equilens` commands share one folder safely.

JAX's bounded cache (`jax._src.lru_cache.LRUCache`, jax 0.10 to 0.12) checks the bound on
every write by listing the folder and reading every entry's access-time file while it
holds the lock: a cost linear in the entries (0.35-0.55 s per write with 6,600 entries on
the 2-core development machine; a fit compiles about 300 programs), paid again by every
process waiting for the lock (jax-ml/jax#36753, unmerged). `compilation_cache` replaces
that check with `_BoundedEviction`: the folder's size is taken once per `RESCAN_SECONDS`
per process (sizes only) and kept as a running total between, and the least recently used
entries are evicted only when the total is over the bound (an entry without its
access-time file counts as the oldest).

JAX's cache key names the device kind ("cpu") but not the CPU's instruction-set
extensions, and XLA:CPU compiles for the host's (AVX-512 where there is one): a program
compiled on one machine and loaded on a machine without those extensions stops the process
with an illegal instruction (SIGILL), after one log line. A cache folder in a home
directory shared between the nodes of a cluster is such a case. `compilation_cache` keeps
each CPU's programs in their own sub-folder (`host_cpu_key()`).

jaxlib 0.9 to 0.11 log two lines to standard error for every program loaded from the
cache on many x86 CPUs (`cpu_aot_loader.cc ... Target machine feature +prefer-no-gather is
not supported on the host machine`, about 3,000 characters each: a warm `equilens demo`
printed 236 of them): XLA compares LLVM's tuning preferences (`+prefer-...`, `+fast-...`),
which are not instructions, with the host's instruction set (openxla/xla#44565; jaxlib
0.12 skips them). The program loads and runs correctly. `compilation_cache` drops exactly
those lines, and only while a cached program is read (`_QuietLoads`): every other line
written to standard error meanwhile, including this check's lines for a real instruction
set, is passed on.
"""

import contextlib
import hashlib
import heapq
import os
import pathlib
import platform
import re
import sys
import tempfile
import threading
import time

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
#: Seconds between two listings of the cache folder's size by one process (other processes'
#: writes in between are counted at the next listing).
RESCAN_SECONDS = 60.0


class _BoundedEviction:
    """The bound check of JAX's `LRUCache.put` without a listing per write (module
    docstring). Installed on the class by `compilation_cache`; `full` is JAX's own check,
    used for folders that are not local paths."""

    def __init__(self, full):
        self.full = full
        self.full_passes = 0

    def __call__(self, cache, *, additional_size: int = 0) -> None:
        if not cache.eviction_enabled:
            return
        where = os.fspath(cache.path)
        if "://" in where:  # a remote folder (etils.epath): JAX's own check
            return self.full(cache, additional_size=additional_size)
        folder = pathlib.Path(where)
        now = time.monotonic()
        state = getattr(cache, "_equilens_size", None)
        if state is None or now - state[1] > RESCAN_SECONDS:
            state = (_entries_size(folder), now)
        size = state[0] + additional_size
        if size > cache.max_size:
            self.full_passes += 1
            size = _evict_oldest(folder, cache.max_size - additional_size) + additional_size
        cache._equilens_size = (size, state[1])


def _entries(folder: pathlib.Path):
    from jax._src.lru_cache import _CACHE_SUFFIX

    with os.scandir(folder) as it:
        for e in it:
            if e.name.endswith(_CACHE_SUFFIX):
                try:
                    yield e.name[: -len(_CACHE_SUFFIX)], e.stat().st_size
                except FileNotFoundError:  # removed by another process meanwhile
                    continue


def _entries_size(folder: pathlib.Path) -> int:
    return sum(size for _, size in _entries(folder))


def _evict_oldest(folder: pathlib.Path, target: int) -> int:
    """Removes the least recently used entries of `folder` until it holds at most `target`
    bytes; returns the bytes left."""
    from jax._src.lru_cache import _ATIME_SUFFIX, _CACHE_SUFFIX

    heap, total = [], 0
    for key, size in _entries(folder):
        try:
            atime = int.from_bytes((folder / f"{key}{_ATIME_SUFFIX}").read_bytes(), "little")
        except FileNotFoundError:
            atime = 0
        heap.append((atime, key, size))
        total += size
    heapq.heapify(heap)
    while total > target and heap:
        _, key, size = heapq.heappop(heap)
        for suffix in (_CACHE_SUFFIX, _ATIME_SUFFIX):
            (folder / f"{key}{suffix}").unlink(missing_ok=True)
        total -= size
    return total


def _install_bounded_eviction() -> _BoundedEviction:
    from jax._src.lru_cache import LRUCache

    current = LRUCache._evict_if_needed
    installed = getattr(current, "check", None)
    if isinstance(installed, _BoundedEviction):
        return installed
    check = _BoundedEviction(current)

    def evict_if_needed(self, *, additional_size: int = 0) -> None:
        check(self, additional_size=additional_size)

    evict_if_needed.check = check  # type: ignore[attr-defined]
    LRUCache._evict_if_needed = evict_if_needed  # type: ignore[method-assign]
    return check


#: One line of jaxlib's CPU loader about an LLVM tuning preference (module docstring).
_TUNING_LINE = re.compile(
    rb"^[EW]\d{4} [\d:.]+ +\d+ cpu_aot_loader\.cc:\d+\] Loading XLA:CPU AOT result\. "
    rb"Target machine feature \+(?:prefer|fast)-[\w-]+ is not +supported[^\n]*(?:\n|$)",
    re.MULTILINE,
)


@contextlib.contextmanager
def _stderr_without(pattern: re.Pattern[bytes]):
    """Standard error (the file descriptor, which C++ writes to) with the lines matching
    `pattern` left out: it is held in a temporary file while the block runs, then the rest
    is written on, in order."""
    try:
        sys.stderr.flush()
        held = tempfile.TemporaryFile()
    except (AttributeError, OSError, ValueError):  # no stderr (pythonw), no temporary file
        yield
        return
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2
        held.close()
        yield
        return
    with held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = memoryview(pattern.sub(b"", held.read()))
            while rest:
                rest = rest[os.write(2, rest) :]


class _QuietLoads:
    """JAX's read of one cached program (`compilation_cache.get_executable_and_time`)
    without jaxlib's lines about LLVM tuning preferences (module docstring). One read at a
    time per process: standard error is one file descriptor for all threads."""

    def __init__(self, read):
        self.read = read
        self.lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock, _stderr_without(_TUNING_LINE):
            return self.read(*args, **kwargs)


def _install_quiet_loads() -> _QuietLoads:
    from jax._src import compilation_cache as cc

    current = cc.get_executable_and_time
    if isinstance(current, _QuietLoads):
        return current
    quiet = _QuietLoads(current)
    cc.get_executable_and_time = quiet  # jax._src.compiler reads it through the module
    return quiet


def host_cpu_key() -> str:
    """A short name for this machine's CPU and its instruction-set extensions, e.g.
    `x86_64-3f2a9c1e07b4`: the name of the sub-folder `compilation_cache` keeps this
    CPU's compiled programs in (module docstring). Two machines get the same key when their
    processor model and extensions are the same."""
    text = ""
    with contextlib.suppress(OSError):
        text = pathlib.Path("/proc/cpuinfo").read_text(errors="replace")
    # the first processor's model and extensions (Linux; "Features" on ARM)
    wanted = ("vendor_id", "model name", "flags", "features", "cpu implementer", "cpu part")
    seen: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name in wanted and name not in seen:
            seen[name] = " ".join(sorted(value.split()))
    described = repr(sorted(seen.items())) if seen else platform.processor()
    digest = hashlib.sha256(described.encode()).hexdigest()[:12]
    return f"{platform.machine() or 'cpu'}-{digest}"


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
    """Keeps JAX's compiled programs in `path` (default `default_cache_dir()`), in a
    sub-folder for this machine's CPU (`host_cpu_key()`), bounded to `max_size` bytes, for
    programs that took at least `min_compile_time` seconds to compile; `path=None` turns
    the persistent cache off for the rest of the process. Returns the folder in use (the
    CPU's sub-folder; None when off). This sets JAX's global configuration
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
    base = default_cache_dir() if path == "default" else pathlib.Path(path)
    folder = base / host_cpu_key()
    folder.mkdir(parents=True, exist_ok=True)
    if path == "default":
        _remove_flat_entries(base)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_compilation_cache_max_size", int(max_size))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _install_bounded_eviction()
    _install_quiet_loads()
    # the cache is opened on first use: a folder changed later in the process is taken up
    cc.reset_cache()
    return folder


def _remove_flat_entries(base: pathlib.Path) -> None:
    """Removes the programs equilens before 2026-11-29 kept directly in the default folder
    (one folder for every CPU), which no process reads any more."""
    from jax._src.lru_cache import _ATIME_SUFFIX, _CACHE_SUFFIX

    with os.scandir(base) as it:
        for e in it:
            if e.is_file() and e.name.endswith((_CACHE_SUFFIX, _ATIME_SUFFIX)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)


def _configure_on_import() -> None:
    """What `import equilens` does: the cache on in `default_cache_dir()` unless the user
    chose otherwise (module docstring)."""
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in _OFF:
        return
    if jax.config.jax_compilation_cache_dir:  # pyright: ignore[reportAttributeAccessIssue]
        # the user's own cache (JAX_COMPILATION_CACHE_DIR or jax.config), read quietly
        _install_quiet_loads()
        return
    try:
        compilation_cache(choice or "default")
    except OSError:
        # a read-only home: run without the cache rather than fail to import
        return
