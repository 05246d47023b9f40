"""A guard against a limit of the operating system that compiled fits reach.

XLA's CPU compiler maps the machine code of every compiled program into memory in many
pieces: a compiled fit of a lens holds 1,000 to 1,600 memory mappings (measured with jax
0.10.1). Linux refuses a process more than `vm.max_map_count` of them (65,530 by default),
so a Python process that compiles about fifty distinct fits (other data shapes, other
model structures) without freeing any dies inside XLA's compiler: `LLVM ERROR: Unable to
allocate section memory`, or a segmentation fault. `jax.clear_caches()` frees the
compiled programs (and their mappings); `sysctl -w vm.max_map_count=262144` raises the
limit. `check_memory_maps` warns before the limit is reached, and frees the compiled
programs just before it (a process that fits many lenses in a loop then compiles again
instead of dying).
"""

import functools
import sys
import warnings

#: The fraction of `vm.max_map_count` at which `check_memory_maps` warns.
MAP_WARNING_FRACTION = 0.75
#: The fraction at which it frees every compiled program (`jax.clear_caches()`).
MAP_FREE_FRACTION = 0.9

_WARNED = [False]


class ResourceLimitWarning(UserWarning):
    """The process is close to a limit of the operating system (see `check_memory_maps`)."""


@functools.cache
def _limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def memory_maps() -> tuple[int, int] | None:
    """`(mappings, limit)`: the memory mappings this process holds and the most Linux
    allows it (`vm.max_map_count`); None where the system does not say (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    limit = _limit()
    if limit is None:
        return None
    try:
        with open("/proc/self/maps", "rb") as f:
            count = f.read().count(b"\n")
    except OSError:
        return None
    return count, limit


def check_memory_maps() -> None:
    """Warns once per process (`ResourceLimitWarning`) when it holds more than
    `MAP_WARNING_FRACTION` of the memory mappings Linux allows it: compiled programs keep
    theirs until they are freed, and at the limit XLA's compiler aborts the process. Past
    `MAP_FREE_FRACTION` it frees every compiled program (`jax.clear_caches()`: what is
    needed again compiles again, or loads from the persistent compilation cache) and
    says so, each time."""
    got = memory_maps()
    if got is None:
        return
    count, limit = got
    if count > MAP_FREE_FRACTION * limit:
        import jax

        jax.clear_caches()
        warnings.warn(
            f"this process held {count} of the {limit} memory mappings Linux allows it "
            "(vm.max_map_count), most of them compiled programs: they were freed "
            "(jax.clear_caches()) before XLA's compiler would abort the process at the "
            "limit; the next fits compile again. Raise the limit (sysctl -w "
            "vm.max_map_count=262144) to keep them",
            ResourceLimitWarning,
            stacklevel=3,
        )
        return
    if _WARNED[0]:
        return
    if count > MAP_WARNING_FRACTION * limit:
        _WARNED[0] = True
        warnings.warn(
            f"this process holds {count} of the {limit} memory mappings Linux allows it "
            "(vm.max_map_count), most of them compiled programs (a compiled lens fit holds "
            "about 1,000): at the limit XLA's compiler aborts the process. Call "
            "jax.clear_caches() between fits of different problems, or raise the limit "
            "(sysctl -w vm.max_map_count=262144); past "
            f"{MAP_FREE_FRACTION:.0%} of it equilens frees the compiled programs itself",
            ResourceLimitWarning,
            stacklevel=3,
        )
