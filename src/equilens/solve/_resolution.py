"""The source mesh's resolution chosen by the Bayesian evidence: `finer_mesh`, and the
stage of `fit_pixelized` that tries finer meshes while the evidence rises by enough
(`finer_mesh_rounds`)."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import numpy as np

from ..source import AbstractMesh, AdaptiveRectangularMesh, RectangularMesh
from ._result import FitResult

#: Each finer mesh has this many times the nodes of the previous one along each side
#: (32 x 32 -> 40 x 40 -> 50 x 50).
MESH_STEP = 1.25
#: A finer mesh is kept when it raises the log-evidence by more than this. Any rise is
#: the evidence preferring the finer source (it pays the extra pixels' Occam factor
#: itself), but an evaluation's cost grows faster than the number of pixels (dense
#: factorisations: 50 / 111 / 253 ms for 32 / 40 / 48 pixels a side, value alone, 2 CPU
#: cores): a rise of a few units does not pay a doubled cost; a coarse mesh's misfit of a
#: real galaxy is worth ~100 (issue 50's suite, lens 2: +98 from 32 to 40 a side).
MESH_GAIN = 10.0
#: At most this many source pixels per pixel of the mask (an evidence needs more data than
#: source pixels): the finer meshes' bound and that of the `equilens` command's default
#: mesh on a small mask (`equilens.cli._source.default_mesh`).
MAX_FILL = 0.5


def finer_mesh(mesh: AbstractMesh, n_data: int) -> AbstractMesh | None:
    """`mesh` with `MESH_STEP` times the nodes along each side (rounded), everything else
    the same, for a `RectangularMesh` or an `AdaptiveRectangularMesh`; `None` for a mesh
    without a shape (a `DelaunayMesh`) or when the finer mesh would have more than
    `MAX_FILL` pixels per pixel of data (`n_data`, the mask's pixels)."""
    if not isinstance(mesh, RectangularMesh | AdaptiveRectangularMesh):
        return None
    shape = (round(mesh.shape[0] * MESH_STEP), round(mesh.shape[1] * MESH_STEP))
    if shape[0] * shape[1] > MAX_FILL * n_data:
        return None
    if isinstance(mesh, RectangularMesh):
        return RectangularMesh(shape, bounds=mesh.bounds, nodes=mesh.nodes)
    return AdaptiveRectangularMesh(
        shape, weight_floor=mesh.weight_floor, weight_power=mesh.weight_power
    )


def finer_mesh_rounds(
    r: FitResult,
    n: int,
    n_data: int,
    refit: Callable[[Any], FitResult],
    record: Callable[[str, FitResult], None],
    say: Callable[[str], None],
) -> FitResult:
    """Up to `n` finer meshes (`finer_mesh`), each from the last kept model with only its
    source mesh replaced, refitted by `refit(model)` (the mass and the regularization by
    the evidence) and recorded as a stage; one is kept when it succeeds and raises the
    log-evidence by more than `MESH_GAIN`, and the rounds stop at the first that does not.
    Returns the last kept result (`r` when none was kept)."""
    for _ in range(n):
        mesh = finer_mesh(r.model.source.mesh, n_data)
        if mesh is None:
            say("    (no finer mesh: a mesh without a shape, or as many pixels as the data allow)")
            break
        trial = refit(eqx.tree_at(lambda s: s.source.mesh, r.model, mesh))
        ny, nx = mesh.shape  # pyright: ignore[reportAttributeAccessIssue]
        record(f"finer source mesh ({ny} x {nx})", trial)
        gain = float(r.value) - float(trial.value)
        if not trial.success or not np.isfinite(gain) or not gain > MESH_GAIN:
            why = trial.message() if not trial.success else f"log evidence {gain:+.1f}"
            say(f"    (not kept: {why}; a finer mesh needs a gain over {MESH_GAIN:g})")
            break
        say(f"    (kept: log evidence {gain:+.1f})")
        r = trial
    return r
