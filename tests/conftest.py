import gc
import os

# Several CPU devices for sharding tests; must be set before JAX initialises a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    # pytest-xdist runs one worker per core: XLA's intra-op thread pool keeps to one thread
    # in each, so that the workers do not oversubscribe the cores (Numba's and BLAS's pools
    # keep their threads: the tests check the parallel kernels with several threads).
    if "intra_op_parallelism_threads" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += (
            " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )

if os.environ.get("EQUILENS_TEST_FAST_COMPILE") == "1":
    # The fast suite's time is mostly XLA compiling small programs once each: LLVM's
    # optimisation level 0 compiles them ~20% faster (measured on the 2-core CI machine)
    # and changes no arithmetic (no fast-math either way); LLVM's expensive passes off too
    # (what `jax_disable_most_optimizations` sets besides: test_light, test_math and
    # test_psf_grid 85.0 and 70.2 -> 78.1 and 65.8 s alternated, one process, empty
    # caches, 2026-12-03). The slow session, the crosscheck and the examples compile as
    # users do.
    os.environ["XLA_FLAGS"] += (
        " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )

import jax  # noqa: E402
import pytest  # noqa: E402

# One Numba cache for the pytest-xdist workers (and the sessions after them): equilens's
# kernels compile one process at a time under a file lock (equilens/numba/_compile_lock.py,
# numba/numba#10128), so a worker loads what the other compiled; set before Numba is
# imported.
if _WORKER and "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".numba-cache", "xdist"
    )

X64 = os.environ.get("EQUILENS_TEST_X64", "1") != "0"
jax.config.update("jax_enable_x64", X64)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config, items):
    if X64:
        return
    # float32 session: checks that need float64, and checks whose outcome does not depend
    # on the precision, are deselected (not skipped): the float64 session of the same
    # matrix runs them.
    once = ("x64_only", "precision_independent")
    keep = [item for item in items if not any(m in item.keywords for m in once)]
    deselected = [item for item in items if any(m in item.keywords for m in once)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep


# Python's cyclic garbage collector in the xdist workers: a worker of the fast suite holds
# 1.5-1.9 million live objects by its end (JAX's tracing and compilation caches, equinox's
# and jaxtyping's), and each full collection scans them all: 13-17 full collections took
# 12.6 s and 19.5 s of the two workers' 284 and 273 s (test_pixelized, test_sample,
# test_nested and test_fit, 2026-11-29). After each full collection (which has just freed
# every unreachable cycle) the objects that survived it are frozen (`gc.freeze`), so the
# next ones scan only what is new; unfrozen before the compiled programs are freed below.
_FULL_COLLECTIONS = [0]


def _count_full_collections(phase, info):
    if phase == "stop" and info["generation"] == 2:
        _FULL_COLLECTIONS[0] += 1


if _WORKER:
    gc.callbacks.append(_count_full_collections)


def _freeze_survivors():
    if _FULL_COLLECTIONS[0]:
        _FULL_COLLECTIONS[0] = 0
        gc.freeze()


def _clear_caches():
    gc.unfreeze()
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _free_compiled_programs(request):
    """XLA's compiled programs freed after each slow test, and after any test that leaves
    the process holding more than half the memory mappings it may. A compiled lens fit
    holds 1,000-1,600 memory mappings, and a process may hold 65,530 (Linux's
    vm.max_map_count): an xdist worker of the slow session that kept every fit it compiled
    reached the limit and was aborted inside XLA's compiler (`LLVM ERROR: Unable to
    allocate section memory`, or a segmentation fault; the core showed 65,531 mappings),
    and so was the one worker of the fast suite run with `-n 1` (a segmentation fault in
    XLA's compiler after ~550 tests)."""
    yield
    if "slow" in request.keywords:
        _clear_caches()
        return
    from equilens._resources import memory_maps

    got = memory_maps()
    if got is not None and got[0] > 0.5 * got[1]:
        _clear_caches()
    elif _WORKER:
        _freeze_survivors()


@pytest.fixture
def getkey():
    """A function returning a fresh PRNG key on each call (deterministic per test)."""
    key = [jax.random.key(0)]

    def _next():
        key[0], sub = jax.random.split(key[0])
        return sub

    return _next
