"""Numba's on-disk cache made safe for processes that compile at the same time.

Several processes that compile one `cache=True` function at once (pytest-xdist workers,
nested sampling's worker processes, a cluster's job array started on a fresh install)
each write its cache files, and a process can then load one compilation's wrapper with
another's kernel: a crash (numba/numba#10128, ctapipe#2837). Each kernel module of this
package ends with `serialise_compilation(globals())`: a kernel is compiled (or loaded from
the cache) under a file lock beside its cache files, one process at a time; the others
wait and then load what it wrote instead of compiling the kernel again (the pytest-xdist
workers of the fast suite compiled every kernel twice: 70 s each).
"""

import os
import threading
from typing import Any

import filelock

# one lock object per path in this process: a kernel compiled while its callers compile
# (a callee's compilation inside its caller's) takes other paths; the same path again in
# one thread (a recursive kernel) re-enters its own lock
_LOCKS: dict[str, filelock.FileLock] = {}
_GUARD = threading.Lock()


def _lock_for(path: str) -> filelock.FileLock:
    with _GUARD:
        lock = _LOCKS.get(path)
        if lock is None:
            lock = _LOCKS[path] = filelock.FileLock(path)
        return lock


def _lock_path(dispatcher: Any) -> str | None:
    """The lock file of a cached dispatcher, beside its cache files (None: not cached, or
    a Numba whose cache does not have the attributes read here)."""
    cache = getattr(dispatcher, "_cache", None)
    folder = getattr(cache, "_cache_path", None)
    base = getattr(getattr(cache, "_impl", None), "_filename_base", None)
    if not isinstance(folder, str) or not isinstance(base, str):
        return None
    return os.path.join(folder, base + ".lock")


def serialise_compilation(namespace: dict[str, Any]) -> None:
    """Every cached Numba dispatcher defined in the module of `namespace` (its
    `globals()`) compiles under its file lock."""
    from numba.core.dispatcher import Dispatcher

    for value in list(namespace.values()):
        if not isinstance(value, Dispatcher):
            continue
        if getattr(value.py_func, "__module__", None) != namespace.get("__name__"):
            continue  # (imported from another kernel module: locked there)
        path = _lock_path(value)
        if path is None:
            continue
        value.compile = _locked(value.compile, path)


#: Seconds a process waits for another's compilation of one kernel (one takes seconds to a
#: minute) before it compiles the kernel itself: a lock whose holder cannot release it (a
#: soft lock file left by a killed process, where the file system has no `flock`) must not
#: stop every later process.
WAIT_SECONDS = 600.0


def _locked(compile_: Any, path: str) -> Any:
    def compile(sig):
        lock = _lock_for(path)
        try:
            # (the folder may not exist before the first kernel is cached)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            lock.acquire(timeout=WAIT_SECONDS)
        except OSError:
            # a folder that takes no lock file takes no cache files either: Numba
            # compiles in memory, as without the lock; a lock held too long
            # (`filelock.Timeout`, an OSError): as without it
            return compile_(sig)
        try:
            return compile_(sig)
        finally:
            lock.release()

    return compile
