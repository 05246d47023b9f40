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
    monkeypatch.setattr(_resources, "_limit", lambda: count)
    with pytest.warns(ResourceLimitWarning, match=r"jax\.clear_caches\(\)"):
        _resources.check_memory_maps()
    assert _limit_warnings(_resources.check_memory_maps) == 0  # once per process
