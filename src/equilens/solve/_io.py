"""Saving and loading models and fit results: equinox serialisation plus readable JSON."""

import io
import json
import os
import zlib
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._files import atomic_path
from .._lens_system import LensSystem
from .._multiband import MultiBandLensSystem
from ..light import AbstractLightProfile, LightSum
from ..mass import MassSum
from ..objective._params import _child
from ..regularization import AdaptiveBrightness
from ..source import AdaptiveRectangularMesh, PixelizedSource
from ._result import FitResult

#: The first bytes of a file written by `save` (then the layout, then equinox's leaves).
_MAGIC = b"EQUILENS-TREE\n"


def _dtype(leaf: Any) -> np.dtype:
    return leaf.dtype if isinstance(leaf, jax.Array | np.ndarray) else np.result_type(leaf)


def _layout(tree: PyTree[Any]) -> tuple[list[str], list[str]]:
    """One line per leaf that `save` writes (equinox writes every array-like leaf, in
    order): the classes from the root down to the leaf, its path, shape and kind of dtype
    (`f`, `i`, `b`, `c`: float32 and float64 files load into each other's models); and
    each leaf's dtype name."""
    out, dtypes = [], []
    for path, leaf in jtu.tree_leaves_with_path(tree):
        if not eqx.is_array_like(leaf):
            continue
        node: Any = tree
        classes = [type(tree).__name__]
        for key in path:
            try:
                node = _child(node, key)
            except KeyError:  # (a key of another kind: no further classes)
                break
            if isinstance(node, eqx.Module):
                classes.append(type(node).__name__)
        shape = "x".join(map(str, np.shape(leaf))) or "scalar"
        out.append(f"{'/'.join(classes)} {jtu.keystr(path)} {shape} {_dtype(leaf).kind}")
        dtypes.append(_dtype(leaf).name)
    return out, dtypes


def save(path: str | os.PathLike, tree: PyTree[Any]) -> None:
    """Writes the array leaves of `tree` (a model or a `FitResult`) to `path`, after a
    description of the tree's layout (its classes, leaf paths and shapes), a checksum of
    that description and one of the leaves, in one step (an interrupted save leaves the
    previous file or none); read it back with `load(path, like)`."""
    leaves = io.BytesIO()
    eqx.tree_serialise_leaves(leaves, tree)
    payload = leaves.getvalue()
    lines, dtypes = _layout(tree)
    header = {"format": 2, "crc32": zlib.crc32(payload), "leaves": lines, "dtypes": dtypes}
    header = json.dumps(header).encode()
    # format 2: the header's own checksum after it (a change that leaves the JSON's meaning,
    # such as a space turned into a tab, is damage too)
    check = zlib.crc32(header).to_bytes(4, "little")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(_MAGIC + len(header).to_bytes(8, "little") + header + check + payload)


def load(path: str | os.PathLike, like: PyTree[Any]) -> PyTree[Any]:
    """Reads leaves saved by `save` into a pytree with the structure of `like` (e.g. the
    starting model, or the `FitResult` of the same fit set-up), cast to `like`'s dtypes (a
    float64 save loads into a float32 model). Raises `ValueError` when the file does not
    exist, is not a saved tree, is damaged or truncated (its checksum), or was saved from a
    tree of another layout (other classes, leaves or shapes: the message names the first
    difference): it never loads one model's numbers into another's fields. (Files written
    by equinox's `tree_serialise_leaves`, as `save` did before equilens 0.1.1, load too;
    for them only the number and size of the leaves can be checked.)"""
    if not os.path.isfile(path):
        raise ValueError(f"no saved model at {path}")
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(_MAGIC):
        start = len(_MAGIC) + 8
        n = int.from_bytes(raw[len(_MAGIC) : start], "little")
        try:
            header = json.loads(raw[start : start + n].decode())
            saved, crc = list(header["leaves"]), int(header["crc32"])
            dtypes = [np.dtype(name) for name in header["dtypes"]]
            version = header["format"]
            if version not in (1, 2):
                raise ValueError(version)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: the saved layout is damaged") from None
        payload = raw[start + n :]
        if version == 2:  # the header's checksum, then the leaves
            if zlib.crc32(raw[start : start + n]).to_bytes(4, "little") != payload[:4]:
                raise ValueError(f"{path}: the saved layout is damaged (its checksum)")
            payload = payload[4:]
        if zlib.crc32(payload) != crc:
            raise ValueError(f"{path} is damaged or truncated (its checksum does not match)")
        wanted, _ = _layout(like)
        if saved != wanted:
            first = next(
                (k for k, (a, b) in enumerate(zip(saved, wanted, strict=False)) if a != b),
                min(len(saved), len(wanted)),
            )
            got = saved[first] if first < len(saved) else "nothing"
            want = wanted[first] if first < len(wanted) else "nothing"
            raise ValueError(
                f"{path} was saved from another layout than `like` ({len(saved)} leaves "
                f"saved, {len(wanted)} wanted); leaf {first}: saved {got!r}, `like` has "
                f"{want!r}"
            )
        # read in the saved dtypes (equinox refuses others), then cast to `like`'s
        stand_in = iter(dtypes)
        into = jtu.tree_map(
            lambda x: np.zeros(np.shape(x), next(stand_in)) if eqx.is_array_like(x) else x, like
        )
    else:
        payload, into = raw, like
    f = io.BytesIO(payload)
    try:
        tree = eqx.tree_deserialise_leaves(f, into)
    except (RuntimeError, ValueError, EOFError, OSError) as err:
        cause = err.__cause__ or err.__context__ or err
        raise ValueError(
            f"{path}: cannot read the saved leaves into `like` ({cause}): not a saved tree, "
            "damaged, or saved from another model"
        ) from None
    if f.read(1):
        raise ValueError(f"{path} holds more leaves than `like`: saved from another model")
    return jtu.tree_map(_like_dtype, tree, like)


def _like_dtype(new: Any, old: Any) -> Any:
    """A loaded leaf as the type and dtype of `like`'s."""
    if isinstance(old, jax.Array):
        return jnp.asarray(new, dtype=old.dtype)
    if isinstance(old, np.ndarray | np.generic):
        return (
            np.asarray(new, dtype=old.dtype)[()]
            if np.ndim(old) == 0
            else np.asarray(new, old.dtype)
        )
    if isinstance(old, bool | int | float | complex):
        return type(old)(np.asarray(new).item())
    return new


def _components(node: Any) -> tuple[Any, ...]:
    return node.components if isinstance(node, (MassSum, LightSum)) else (node,)


def _entries(system: LensSystem | MultiBandLensSystem) -> list[dict[str, Any]]:
    """One entry per component: its field, index, band (multi-band light), the path
    prefix of its parameters in `FitResult.names`, and the prefix of the copy whose
    parameters it shares (band 0's, for a shared multi-band field), and the component."""
    out = []
    for field in ("mass", "lens_light", "source"):
        node = getattr(system, field)
        if node is None:
            continue
        shared_fields = system.shared if isinstance(system, MultiBandLensSystem) else ()
        per_band = isinstance(system, MultiBandLensSystem) and field != "mass"
        for band, sub in enumerate(node if per_band else (node,)):
            base = f"{field}[{band}]" if per_band else field
            shared = f"{field}[0]" if field in shared_fields else base
            for i, comp in enumerate(_components(sub)):
                inner = f".components[{i}]" if isinstance(sub, (MassSum, LightSum)) else ""
                out.append(
                    {
                        "field": field,
                        "index": i,
                        "band": band if per_band else None,
                        "prefix": base + inner,
                        "shared_prefix": shared + inner,
                        "component": comp,
                    }
                )
    return out


def _plain(x: Any) -> Any:
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def _band_fields(comp: Any) -> tuple[str, ...]:
    from .._multiband import _band_fields as fields

    return fields(comp) if isinstance(comp, AbstractLightProfile) else ()


def result_to_dict(result: FitResult, band_names: Sequence[str] | None = None) -> dict[str, Any]:
    """A JSON-ready summary of a fit of a `LensSystem` or a `MultiBandLensSystem`: per
    component its field (`mass`, `lens_light`, `source`), index, class name and every
    parameter by keyword name with its 1-sigma error (None for parameters held fixed;
    amplitudes solved linearly are marked `"linear"`), plus chi2, reduced chi2, steps,
    status (`success`, and `notes` saying why a result is implausible) and wall time.

    For a multi-band model each light component also names its `band` (`band_names`, e.g.
    `MultiBandTerm.names`; default the band's index): its amplitudes are that band's, and
    the shape parameters of a shared field are reported in every band with the error of
    the one shared parameter."""
    system = result.model
    if not isinstance(system, LensSystem | MultiBandLensSystem):
        raise TypeError("result_to_dict needs the result of fitting a LensSystem")
    errors = dict(zip(result.names, np.asarray(result.errors).tolist(), strict=True))
    if isinstance(system, MultiBandLensSystem):
        names = list(band_names) if band_names is not None else list(range(system.n_bands))
        if len(names) != system.n_bands:
            raise ValueError(f"{len(names)} band names for {system.n_bands} bands")
        bands = system.bands()
        solved = [set(b.linear_components()) if result.n_linear else set() for b in bands]
    else:
        names = []
        solved = [set(system.linear_components()) if result.n_linear else set()]
    comps = []
    for e in _entries(system):
        field, i, comp, band = e["field"], e["index"], e["component"], e["band"]
        params = {}
        leaves = jtu.tree_flatten_with_path(comp)[0]
        if isinstance(comp, PixelizedSource):  # its values go to a FITS image, not the JSON
            leaves = jtu.tree_flatten_with_path(comp.regularization)[0]
            leaves = [((jtu.GetAttrKey("regularization"), *p), v) for p, v in leaves]
        own = _band_fields(comp)
        for path, leaf in leaves:
            name = jtu.keystr(path).lstrip(".")
            prefix = e["prefix"] if name.split(".")[0] in own else e["shared_prefix"]
            full = f"{prefix}.{name}"
            if np.ndim(leaf) == 0:
                err = errors.get(full)
            else:
                err = [errors.get(f"{full}[{k}]") for k in range(np.size(leaf))]
                err = None if all(x is None for x in err) else err
            linear = name == "amp" and (field, i) in solved[band or 0]
            params[name] = {"value": _plain(leaf), "error": "linear" if linear else err}
        entry = {"field": field, "index": i, "class": type(comp).__name__, "parameters": params}
        if band is not None:
            entry["band"] = names[band]
        if isinstance(comp, PixelizedSource):
            entry["mesh"] = type(comp.mesh).__name__
            entry["regularization"] = type(comp.regularization).__name__
            entry["n_pixels"] = comp.n_pixels
            mesh = comp.mesh
            if isinstance(mesh, AdaptiveRectangularMesh) and mesh.uses_signal:
                # (the brightness weights' settings)
                entry["mesh_weights"] = {
                    "weight_floor": mesh.weight_floor,
                    "weight_power": mesh.weight_power,
                }
            if isinstance(comp.regularization, AdaptiveBrightness):
                # (its static setting: the fitted hyperparameters are in "parameters")
                entry["signal_floor"] = comp.regularization.signal_floor
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
        "arc_residuals": None if result.arc_residuals is None else result.arc_residuals.to_dict(),
        "wall_time_s": float(result.wall_time),
    }


def write_json(
    path: str | os.PathLike,
    result: FitResult,
    band_names: Sequence[str] | None = None,
    **extra: Any,
) -> None:
    """Writes `result_to_dict(result, band_names)` (plus `extra` keys) to `path` as
    indented JSON."""
    out = result_to_dict(result, band_names)
    out.update(extra)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(out, f, indent=2, allow_nan=True)
