"""The guard against the process's limit of memory mappings (`equilens._resources`)."""

import sys
import warnings

import pytest

from equilens import ResourceLimitWarning, _resources


def _limit_warnings(call) -> int:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        call()
    return sum(issubclass(w.category, ResourceLimitWarning) for w in records)


@pytest.mark.precision_independent
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_memory_maps_are_counted_and_a_warning_comes_once_near_the_limit(monkeypatch):
    got = _resources.memory_maps()
    assert got is not None
    count, limit = got
    assert 0 < count < limit
    with open("/proc/self/maps") as f:
        assert abs(sum(1 for _ in f) - count) < 50  # (the process maps memory meanwhile)
    monkeypatch.setattr(_resources, "_WARNED", [False])
    assert _limit_warnings(_resources.check_memory_maps) == 0  # far from the real limit
    # (between the warning's fraction and the freeing's: warned once, nothing freed)
    monkeypatch.setattr(_resources, "_limit", lambda: int(count / 0.82))
    with pytest.warns(ResourceLimitWarning, match=r"jax\.clear_caches\(\)"):
        _resources.check_memory_maps()
    assert _limit_warnings(_resources.check_memory_maps) == 0  # once per process


@pytest.mark.precision_independent
def test_compiled_programs_are_freed_just_before_the_limit(monkeypatch):
    import jax

    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    monkeypatch.setattr(_resources, "_WARNED", [False])
    # between the warning and the freeing: a warning, nothing freed
    monkeypatch.setattr(_resources, "memory_maps", lambda: (80, 100))
    assert _limit_warnings(_resources.check_memory_maps) == 1 and not cleared
    # past MAP_FREE_FRACTION: freed, and said, every time (the warning above came once)
    monkeypatch.setattr(_resources, "memory_maps", lambda: (95, 100))
    with pytest.warns(ResourceLimitWarning, match="were freed"):
        _resources.check_memory_maps()
    assert _limit_warnings(_resources.check_memory_maps) == 1 and len(cleared) == 2
    # where the system does not say (not Linux): nothing
    monkeypatch.setattr(_resources, "memory_maps", lambda: None)
    assert _limit_warnings(_resources.check_memory_maps) == 0 and len(cleared) == 2
