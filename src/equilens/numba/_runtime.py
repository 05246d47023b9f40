"""The host side of the Numba kernels: loading them, their thread counts and BLAS's.

Numba's threading layer must not be entered from two threads at once (JAX may run two
host callbacks concurrently), so kernel calls are serialised here, and BLAS is held to one
thread inside the kernels' parallel loops (its own threads would oversubscribe the cores).
"""

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np


def numba_available() -> bool:
    """Whether Numba can be imported (the "sparse" route needs it)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """The Numba kernels module (compiled on first use, cached on disk)."""
    from . import _sparse_kernels

    return _sparse_kernels


# Numba's default threading layer must not be entered from two threads at once (JAX may
# run two callbacks concurrently): kernel calls are serialised.
_LOCK = threading.Lock()


@functools.cache
def _blas_threads():
    """A controller of the BLAS libraries' thread pools (threadpoolctl), made once after
    the kernels (and so SciPy's BLAS) are loaded."""
    from threadpoolctl import ThreadpoolController

    _kernels()
    return ThreadpoolController()


#: At most this many BLAS threads in the host solve's LAPACK calls: all 16 cores of a
#: 16-core Xeon made the log-evidence 1.7x slower next to Numba's kernels, 4 or 8 were the
#: fastest (docs/performance.md).
LAPACK_THREADS = 8


# BLAS's thread count is process-wide: limits are set and restored one at a time (two
# overlapping limits restored out of order would leave BLAS at the inner one's count); a
# limit may nest inside another of the same thread (it can only lower the count).
_BLAS_LOCK = threading.RLock()


@contextlib.contextmanager
def blas_threads(most: int):
    """Holds BLAS to at most `most` threads (and never to more than it has now, which
    `OPENBLAS_NUM_THREADS` or threadpoolctl may have lowered) inside the block."""
    with _BLAS_LOCK:
        controller = _blas_threads()
        now = max(
            (lib["num_threads"] for lib in controller.info() if lib["user_api"] == "blas"),
            default=1,
        )
        with controller.limit(limits=max(1, min(most, now)), user_api="blas"):
            yield


def _threads() -> int:
    """Numba's thread count, at most the cores this process may run on."""
    import numba

    n = int(numba.get_num_threads())
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        n = min(n, len(affinity(0)))
    return max(n, 1)


def host64(*arrays) -> list[np.ndarray]:
    """The kernels' operands: integer arrays as int64, floating ones as float64."""
    return [
        np.asarray(x, np.int64 if np.issubdtype(x.dtype, np.integer) else np.float64)
        for x in arrays
    ]


def run_kernel(name: str, *args, **kwargs):
    """`kernel(n_threads, *args, **kwargs)` of `_sparse_kernels`, one call at a time, with BLAS
    single-threaded: the kernels call BLAS on small blocks from each of Numba's threads,
    and BLAS's own threads would oversubscribe the cores (measured 2-4x slower at 2 to 16
    threads)."""
    with _LOCK, blas_threads(1):
        return getattr(_kernels(), name)(_threads(), *args, **kwargs)


def per_object(cache: dict, obj: Any, make: Callable[[Any], Any]) -> Any:
    """`make(obj)`, made once per live object: kept in `cache` under `id(obj)` while `obj`
    lives (a weak reference drops the entry with it, so a new object at a reused id is
    never served an old one's)."""
    key = id(obj)
    entry = cache.get(key)
    if entry is not None and entry[0]() is obj:
        return entry[1]
    value = make(obj)
    cache[key] = (weakref.ref(obj, lambda _, key=key: cache.pop(key, None)), value)
    return value
