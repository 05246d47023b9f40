"""Compiled programs kept on disk (`equilens._cache`): on at import in the user's cache
folder, the user's own JAX cache respected, switched off by EQUILENS_COMPILATION_CACHE=0;
a second process loads what the first compiled. Each case runs in its own Python process
(the cache is JAX's global configuration)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.precision_independent

# compiles one program (a fit's worth of work is not needed: the threshold is set to 0),
# then reports JAX's cache folder and the cache hits JAX's monitoring counted
SCRIPT = """
import json, sys
import jax
from jax._src import monitoring
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
)
import equilens as el
if sys.argv[1] == "set":
    el.compilation_cache(sys.argv[2], min_compile_time=0.0)

@jax.jit
def f(x):
    return jax.numpy.sin(x) @ jax.numpy.cos(x).T + 3.25

f(jax.numpy.ones((7, 5))).block_until_ready()
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir,
                  "enabled": jax.config.jax_enable_compilation_cache,
                  "hits": len(hits)}))
"""


def _run(tmp_path, *args: str, **env: str) -> dict:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_COMPILATION_CACHE_DIR", "EQUILENS_COMPILATION_CACHE")
    }
    base["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *(args or ("default",))],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_on_by_default_in_the_users_cache_folder(tmp_path):
    got = _run(tmp_path)
    assert got["dir"] == str(tmp_path / "xdg" / "equilens" / "jax")
    assert got["enabled"] is True
    assert os.path.isdir(got["dir"])


def test_the_users_own_cache_and_the_switch_are_respected(tmp_path):
    mine = str(tmp_path / "mine")
    assert _run(tmp_path, JAX_COMPILATION_CACHE_DIR=mine)["dir"] == mine
    off = _run(tmp_path, EQUILENS_COMPILATION_CACHE="0")
    assert off["dir"] is None
    assert not (tmp_path / "xdg" / "equilens").exists()
    there = str(tmp_path / "there")
    assert _run(tmp_path, EQUILENS_COMPILATION_CACHE=there)["dir"] == there


def test_a_second_process_loads_the_compiled_program(tmp_path):
    folder = str(tmp_path / "cache")
    first = _run(tmp_path, "set", folder)
    assert first["hits"] == 0
    assert os.listdir(folder)  # the program was written
    second = _run(tmp_path, "set", folder)
    assert second["hits"] >= 1  # ... and read back instead of compiled


def test_bad_settings_are_refused(tmp_path):
    import equilens as el

    with pytest.raises(ValueError, match="max_size"):
        el.compilation_cache(tmp_path, max_size=0)
    with pytest.raises(ValueError, match="min_compile_time"):
        el.compilation_cache(tmp_path, min_compile_time=-1.0)


def test_the_bound_is_kept_without_listing_the_folder_on_every_write(tmp_path, monkeypatch):
    """JAX's bounded cache with equilens's check (`_BoundedEviction`): writes under the
    bound evict nothing and read no access times; over it, the least recently used go
    first, an entry without its access-time file before all."""
    from jax._src.lru_cache import LRUCache

    from equilens import _cache

    check = _cache._install_bounded_eviction()
    assert _cache._install_bounded_eviction() is check
    cache = LRUCache(str(tmp_path), max_size=10_000)
    before = check.full_passes
    for i in range(8):
        cache.put(f"k{i}", bytes(1000))
    assert check.full_passes == before
    assert cache.get("k0") == bytes(1000)  # k0 is now the most recently used
    # left by a process stopped between its two writes; seen at the next listing
    (tmp_path / "orphan-cache").write_bytes(bytes(500))
    monkeypatch.setattr(_cache, "RESCAN_SECONDS", 0.0)
    cache.put("k8", bytes(1000))  # 9,500 bytes: still under
    assert check.full_passes == before
    cache.put("k9", bytes(1000))  # the orphan goes
    cache.put("k10", bytes(1000))  # then k1, the least recently used
    assert check.full_passes == before + 2
    left = {p.name.removesuffix("-cache") for p in tmp_path.glob("*-cache")}
    assert left == {"k0", *(f"k{i}" for i in range(2, 11))}
    assert sum(p.stat().st_size for p in tmp_path.glob("*-cache")) <= 10_000
    assert not (tmp_path / "k1-atime").exists()
