"""The smooth model of `equilens subhalo`, kept beside the scan's cells' file for a rerun.

A scan resumes from its cells' file only when its smooth model's evidence is the one the
file was written against (`subhalo_scan(checkpoint=...)`). The smooth model comes from the
parametric fit and the pixelized evidence chain, minutes of work, whose stopping point
could differ between runs (one run in three beside other work did, 2026-12-03): a rerun
that fitted it again could find its cells' file unusable. So the command writes the smooth
fit (and the chain's brightness estimate) to `OUT_smooth.pkl` with a fingerprint of what
produced it (the data, the settings, the equilens version and the float precision), and a
rerun with the same fingerprint reads it back instead of fitting again.

The file is a Python pickle, read only by the run that wrote its fingerprint's inputs:
a file from elsewhere is as trusted as any pickle (never load one you did not write).
"""

import hashlib
import json
import os
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._files import atomic_path

#: The layout of the file (a change of it makes older files refitted, never misread).
#: 2: `AdaptiveBrightness` gained `signal_floor` (a model pickled before it lacks the field).
FORMAT = 2


def fingerprint(imaging: Any, settings: dict[str, Any]) -> str:
    """A SHA-256 of `imaging`'s arrays and structure (data, noise, PSF, mask, grid) and of
    `settings` (JSON-able: the smooth fit's options), the equilens version and whether
    JAX runs in float64: equal for the inputs of one smooth fit, different for any change."""
    from .. import __version__

    h = hashlib.sha256()
    meta = {
        "format": FORMAT,
        "equilens": __version__,
        "x64": jnp.result_type(float) == jnp.float64,
        "settings": settings,
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    h.update(str(jax.tree.structure(imaging)).encode())
    for leaf in jax.tree.leaves(imaging):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{a.shape}{a.dtype.str}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_smooth(path: str, key: str, smooth: Any, adapt_image: Any) -> None:
    """Writes the smooth fit (a `FitResult`) and the chain's brightness estimate (an array,
    or None) to `path` under the fingerprint `key`, in one step (an interrupted write
    leaves the previous file or none)."""
    payload = {"format": FORMAT, "key": key, "smooth": smooth, "adapt_image": adapt_image}
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_smooth(path: str, key: str) -> tuple[tuple[Any, Any] | None, str]:
    """`((smooth, adapt_image), why)` from `path` when it holds the fit of the inputs with
    fingerprint `key`; `(None, why)` otherwise (no file, another fingerprint, an older
    layout or a file that does not unpickle: the smooth model is then fitted again)."""
    if not os.path.isfile(path):
        return None, "no kept smooth model"
    try:
        with open(path, "rb") as f:
            payload = pickle.load(f)
    except Exception as e:  # (a damaged or foreign file: fitted again, never fatal)
        return None, f"{path} could not be read ({type(e).__name__}): fitting it again"
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return None, f"{path} is of another layout: fitting it again"
    if payload.get("key") != key:
        return None, f"{path} is of other data or settings: fitting it again"
    return (payload["smooth"], payload["adapt_image"]), f"read from {path}"
