"""Compiled programs kept on disk (`equilens._cache`): on at import in the user's cache
folder (one sub-folder per CPU), the user's own JAX cache respected, switched off by
EQUILENS_COMPILATION_CACHE=0; a second process loads what the first compiled, without
jaxlib's lines about LLVM tuning preferences. Each case runs in its own Python process
(the cache is JAX's global configuration)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import slow_ci

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


def _run(tmp_path, *args: str, stderr: list | None = None, **env: str) -> dict:
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
    if stderr is not None:
        stderr.append(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_on_by_default_in_the_users_cache_folder(tmp_path):
    from equilens._cache import host_cpu_key

    base = tmp_path / "xdg" / "equilens" / "jax"
    base.mkdir(parents=True)
    # programs kept directly in the folder by equilens before the per-CPU sub-folders
    for name in ("jit_f-0a1b-cache", "jit_f-0a1b-atime", "notes.txt"):
        (base / name).write_bytes(b"x")
    got = _run(tmp_path)
    assert got["dir"] == str(base / host_cpu_key())
    assert got["enabled"] is True
    assert os.path.isdir(got["dir"])
    assert sorted(p.name for p in base.iterdir()) == sorted([host_cpu_key(), "notes.txt"])


@slow_ci
def test_the_users_own_cache_and_the_switch_are_respected(tmp_path):
    mine = str(tmp_path / "mine")
    assert _run(tmp_path, JAX_COMPILATION_CACHE_DIR=mine)["dir"] == mine
    off = _run(tmp_path, EQUILENS_COMPILATION_CACHE="0")
    assert off["dir"] is None
    assert not (tmp_path / "xdg" / "equilens").exists()
    there = tmp_path / "there"
    got = _run(tmp_path, EQUILENS_COMPILATION_CACHE=str(there))["dir"]
    assert os.path.dirname(got) == str(there)


@slow_ci
def test_a_second_process_loads_the_compiled_program(tmp_path):
    folder = str(tmp_path / "cache")
    first = _run(tmp_path, "set", folder)
    assert first["hits"] == 0
    assert os.listdir(first["dir"])  # the program was written
    printed: list[str] = []
    second = _run(tmp_path, "set", folder, stderr=printed)
    assert second["hits"] >= 1  # ... and read back instead of compiled
    # jaxlib 0.9-0.11 log two ~3,000-character lines per program loaded on AVX-512 CPUs
    assert "cpu_aot_loader" not in printed[0]


def test_each_cpu_keeps_its_programs_apart():
    """JAX's cache key does not name the CPU's instruction sets: programs compiled for
    AVX-512 must not be loaded on a machine without it (a shared home folder)."""
    from equilens._cache import host_cpu_key

    key = host_cpu_key()
    assert key == host_cpu_key()
    machine, _, digest = key.rpartition("-")
    assert machine and len(digest) == 12 and int(digest, 16) >= 0


def test_only_the_loaders_tuning_lines_are_left_out(capfd):
    """While a cached program is read, standard error passes through unchanged except
    jaxlib's lines about LLVM tuning preferences; a missing instruction set is still told."""
    from equilens import _cache

    head = "E1129 06:16:37.935840   14046 cpu_aot_loader.cc:195] Loading XLA:CPU AOT result. "
    tuning = head + "Target machine feature +prefer-no-gather is not  supported on the host [a]\n"
    fast = head + "Target machine feature +fast-gather is not  supported on the host [b]\n"
    real = head + "Target machine feature +avx512f is not  supported on the host [c]\n"

    def read(*args):
        os.write(2, f"before\n{tuning}{fast}{real}".encode())
        os.write(2, f"{tuning}after".encode())
        return args

    quiet = _cache._QuietLoads(read)
    assert quiet(1, 2) == (1, 2)
    os.write(2, b"\nlater\n")
    err = capfd.readouterr().err
    assert err == f"before\n{real}after\nlater\n"


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
