"""Saving and loading models and fit results: equinox serialisation plus readable JSON."""

import json
import os
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._lens_system import LensSystem
from ..light import LightSum
from ..mass import MassSum
from ..source import PixelizedSource
from ._result import FitResult


def save(path: str | os.PathLike, tree: PyTree[Any]) -> None:
    """Writes the array leaves of `tree` (a model or a `FitResult`) to `path` with
    `equinox.tree_serialise_leaves`; read them back with `load(path, like)`."""
    eqx.tree_serialise_leaves(str(path), tree)


def load(path: str | os.PathLike, like: PyTree[Any]) -> PyTree[Any]:
    """Reads leaves saved by `save` into a pytree with the structure of `like` (e.g. the
    starting model, or the `FitResult` of the same fit set-up). Raises `ValueError` when
    the file does not exist."""
    if not os.path.isfile(path):
        raise ValueError(f"no saved model at {path}")
    return eqx.tree_deserialise_leaves(str(path), like)


def _components(system: LensSystem) -> list[tuple[str, int, Any]]:
    out = []
    for field in ("mass", "lens_light", "source"):
        node = getattr(system, field)
        if node is None:
            continue
        comps = node.components if isinstance(node, (MassSum, LightSum)) else (node,)
        for i, c in enumerate(comps):
            out.append((field, i, c))
    return out


def _plain(x: Any) -> Any:
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def result_to_dict(result: FitResult) -> dict[str, Any]:
    """A JSON-ready summary of a fit of a `LensSystem`: per component its field
    (`mass`, `lens_light`, `source`), index, class name and every parameter by keyword name
    with its 1-sigma error (None for parameters held fixed; amplitudes solved linearly are
    marked `"linear"`), plus chi2, reduced chi2, steps, status (`success`, and `notes` saying why a
    result is implausible) and wall time."""
    system = result.model
    if not isinstance(system, LensSystem):
        raise TypeError("result_to_dict needs the result of fitting a LensSystem")
    errors = dict(zip(result.names, np.asarray(result.errors).tolist(), strict=True))
    solved = set(system.linear_components()) if result.n_linear else set()
    comps = []
    for field, i, comp in _components(system):
        prefix = field
        node = getattr(system, field)
        if isinstance(node, (MassSum, LightSum)):
            prefix = f"{field}.components[{i}]"
        params = {}
        leaves = jtu.tree_flatten_with_path(comp)[0]
        if isinstance(comp, PixelizedSource):  # its values go to a FITS image, not the JSON
            leaves = jtu.tree_flatten_with_path(comp.regularization)[0]
            leaves = [((jtu.GetAttrKey("regularization"), *p), v) for p, v in leaves]
        for path, leaf in leaves:
            name = jtu.keystr(path).lstrip(".")
            full = f"{prefix}.{name}"
            if np.ndim(leaf) == 0:
                err = errors.get(full)
            else:
                err = [errors.get(f"{full}[{k}]") for k in range(np.size(leaf))]
                err = None if all(e is None for e in err) else err
            params[name] = {
                "value": _plain(leaf),
                "error": "linear" if name == "amp" and (field, i) in solved else err,
            }
        entry = {"field": field, "index": i, "class": type(comp).__name__, "parameters": params}
        if isinstance(comp, PixelizedSource):
            entry["mesh"] = type(comp.mesh).__name__
            entry["regularization"] = type(comp.regularization).__name__
            entry["n_pixels"] = comp.n_pixels
        comps.append(entry)
    return {
        "components": comps,
        "chi2": float(result.chi2),
        "reduced_chi2": float(result.reduced_chi2),
        "n_data": result.n_data,
        "n_free": result.n_free,
        "n_linear": result.n_linear,
        "objective": float(result.value),
        "num_steps": int(result.num_steps),
        "solver": result.solver,
        "status": result.message(),
        "success": result.success,
        "notes": list(result.notes),
        "wall_time_s": result.wall_time,
    }


def write_json(path: str | os.PathLike, result: FitResult, **extra: Any) -> None:
    """Writes `result_to_dict(result)` (plus `extra` keys) to `path` as indented JSON."""
    out = result_to_dict(result)
    out.update(extra)
    with open(path, "w") as f:
        json.dump(out, f, indent=2, allow_nan=True)
