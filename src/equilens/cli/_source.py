"""The pixelized source of `fit` and `sample`: the mesh and regularization from their
options, the default mesh, the chain run from a parametric fit, the reconstruction written
as FITS."""

from typing import Any

from .._files import atomic_path

MESHES = ("rectangular", "adaptive", "brightness", "delaunay")
REGULARIZATIONS = ("constant", "curvature", "adaptive", "matern")
DEFAULT_MESH_SHAPE = {"rectangular": (32, 32), "adaptive": (24, 24), "brightness": (24, 24)}
#: The `weight_floor` of the `brightness` mesh (`AdaptiveRectangularMesh`): of 0.03, 0.1
#: and 0.3 (power 1) and 0.1 (power 0.5), 0.1 gave the highest smooth log-evidence on
#: issue 50's suite lens 2 (by 3-63); one lens, stated as such (docs/pixelized.md)
BRIGHTNESS_FLOOR = 0.1
#: The pixelized source's mesh when `--mesh` is not given: a mesh adapted to the
#: magnification puts its pixels where the arcs resolve the source (on the realistic
#: suite's bright arcs, log-evidence +2,300 over the 32x32 rectangular mesh at the same
#: number of pixels and cost) ...
DEFAULT_MESH = "adaptive:32x32"


def default_mesh(imaging, kind: str = "adaptive") -> str:
    """The `--mesh` spec used when none is given: `DEFAULT_MESH` (of `kind`, "adaptive"
    or "brightness"), or on a mask of fewer than 2,048 pixels an NxN mesh of at most
    `equilens.solve.MAX_FILL` source pixels per masked pixel (an evidence needs more data
    than source pixels; the bound of the chain's finer meshes too): a smaller square mesh
    on a small mask, e.g. a Euclid cutout of a 1" lens. Raises `ValueError` for a mask too
    small for a pixelized source (under 128 pixels: an 8x8 mesh)."""
    import math

    import numpy as np

    from ..solve import MAX_FILL  # (here, not at the top: the CLI starts without JAX)

    n = int(np.asarray(imaging.mask).sum())
    side = min(32, math.isqrt(int(n * MAX_FILL)))
    if side < 8:
        raise ValueError(
            f"the mask has {n} pixels: too few for a pixelized source (at least 128, for an "
            "8x8 mesh); use a larger --mask-radius"
        )
    return DEFAULT_MESH.replace("adaptive", kind) if side == 32 else f"{kind}:{side}x{side}"


DEFAULT_DELAUNAY_NODES = 500


def make_mesh(spec: str, imaging):
    """A source mesh from a command-line spec: `rectangular[:NYxNX]`, `adaptive[:NYxNX]`
    (adapted to the magnification), `brightness[:NYxNX]` (to the magnification and the
    source's brightness: `AdaptiveRectangularMesh(weight_floor=BRIGHTNESS_FLOOR)`) or
    `delaunay[:N]` (N nodes picked evenly over the mask)."""
    import numpy as np

    from ..source import AdaptiveRectangularMesh, DelaunayMesh, RectangularMesh

    kind, _, size = spec.partition(":")
    if kind not in MESHES:
        raise ValueError(f"--mesh must be one of {', '.join(MESHES)} (got {spec!r})")
    try:
        if kind == "delaunay":
            n = int(size) if size else DEFAULT_DELAUNAY_NODES
            if n < 3:
                raise ValueError(f"a Delaunay mesh needs >= 3 nodes, got {n}")
            n = min(n, int(np.asarray(imaging.mask).sum()) // 2)
            return DelaunayMesh.from_mask(imaging.grid, np.asarray(imaging.mask), n)
        shape = tuple(int(v) for v in size.lower().split("x")) if size else DEFAULT_MESH_SHAPE[kind]
    except ValueError as err:
        raise ValueError(f"bad --mesh size in {spec!r}: {err}") from None
    if len(shape) != 2:
        raise ValueError(f"--mesh {kind} size must be NYxNX, got {size!r}")
    try:
        if kind == "rectangular":
            return RectangularMesh(shape)
        floor = BRIGHTNESS_FLOOR if kind == "brightness" else None
        return AdaptiveRectangularMesh(shape, weight_floor=floor)  # pyright: ignore[reportArgumentType]
    except ValueError as err:
        raise ValueError(f"bad --mesh {spec!r}: {err}") from None


def make_regularization(name: str, strength: float | None):
    """A regularization from its command-line name, at `strength` (default 1)."""
    from ..regularization import (
        AdaptiveBrightness,
        ConstantRegularization,
        CurvatureRegularization,
        MaternKernel,
    )

    c = 1.0 if strength is None else float(strength)
    if not c > 0:
        raise ValueError(f"--regularization-strength must be > 0, got {strength}")
    if name == "constant":
        return ConstantRegularization(c)
    if name == "curvature":
        return CurvatureRegularization(c)
    if name == "adaptive":
        return AdaptiveBrightness(c, c, 1.0)
    if name == "matern":
        return MaternKernel(c, 0.1, nu=1.5)
    raise ValueError(f"--regularization must be one of {', '.join(REGULARIZATIONS)} (got {name!r})")


def write_source_fits(path: str, inversion, n: int = 120) -> None:
    """The source interpolated to a regular source-plane grid (HDU 0, flux/arcsec^2) and its
    1-sigma errors (HDU 1), with the grid in the header (arcsec)."""
    import numpy as np
    from astropy.io import fits

    from ..plot import source_plane_grid

    grid = source_plane_grid(inversion, n)
    header = fits.Header()
    header["BUNIT"] = ("flux/arcsec^2", "surface brightness of the reconstructed source")
    header["PIXSCALE"] = (grid.pixel_scale, "arcsec per pixel (source plane)")
    header["XCENTER"] = (grid.origin[0], "x of the array centre (arcsec)")
    header["YCENTER"] = (grid.origin[1], "y of the array centre (arcsec)")
    header["LOGEVID"] = (float(inversion.log_evidence), "log Bayesian evidence")
    primary = fits.PrimaryHDU(np.asarray(inversion.source_image(grid)), header=header)
    errors = fits.ImageHDU(np.asarray(inversion.error_image(grid)), name="ERRORS")
    with atomic_path(path) as tmp:
        fits.HDUList([primary, errors]).writeto(tmp, overwrite=True)


def _pixelized_stage(
    imaging,
    parametric,
    mesh,
    regularization,
    strength,
    solver,
    max_steps,
    positions,
    progress,
    power_law=False,
    finer_meshes=0,
    covariance=True,
    alternatives=(),
) -> tuple[Any, Any, list, Any]:
    """`fit_pixelized` from a parametric fit (its mass and lens light, the lens light held),
    as `equilens fit --source pixelized` runs it: the regularization's strength fitted
    unless `strength` is given, the images of one source point held together (the given
    `positions`, or the images of the parametric source's centre), the power-law stage
    when `power_law`, up to `finer_meshes` finer source meshes kept where the evidence
    rises, the errors unless `covariance` is False (`fit_pixelized`). `alternatives`:
    other parametric minima (`FitResult`s: the search's, `parametric_fit`'s `minima`); the
    chain then starts from the mass and lens light of the one of these with the highest
    log evidence (`rank_starts`) where it is more than `START_GAIN` above the parametric
    fit's, and the held positions are that model's. Returns the result, the inversion,
    the stage records and the held positions (or None)."""
    import numpy as np

    from ..solve import START_GAIN, auto_positions, fit_pixelized, pixelized_model, rank_starts

    model = parametric.model
    if alternatives:
        models = [model, *(a.model for a in alternatives)]
        log_ev = rank_starts(
            imaging,
            [pixelized_model(m, mesh, regularization) for m in models],
            fit_strength=strength is None,
        )
        if np.isfinite(log_ev).any():
            k = int(np.nanargmax(log_ev))
            ranked = ", ".join(f"{v:.1f}" for v in log_ev[1:])
            print(
                f"  chain start by the log evidence: the parametric fit's model "
                f"{log_ev[0]:.1f}; the search's minima (lowest chi2 first) {ranked}"
            )
            gain = log_ev[k] - log_ev[0] if np.isfinite(log_ev[0]) else np.inf
            if k > 0 and gain > START_GAIN:
                print(
                    f"    (the chain starts from the search's minimum {k}: "
                    f"{'+inf' if not np.isfinite(gain) else f'{gain:+.1f}'} over the fit's)"
                )
                model = models[k]
    held = positions if positions is not None else auto_positions(imaging, model)
    start = pixelized_model(model, mesh, regularization)
    # the evidence is not least squares: lm -> the pipeline's default minimiser
    result, inversion, stages = fit_pixelized(
        imaging,
        start,
        solver=None if solver == "lm" else solver,
        fit_strength=strength is None,
        lens_light="fixed",
        max_steps=1000 if max_steps is None else max_steps,
        positions=held,
        progress=progress,
        power_law=power_law,
        finer_meshes=finer_meshes,
        covariance=covariance,
    )
    return result, inversion, stages, held
