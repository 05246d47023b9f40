"""Figures (matplotlib, imported lazily): a fit's data, model, residuals and source."""

import dataclasses
import os

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from ._files import atomic_path
from ._grid import Grid
from ._lens_system import LensSystem
from .data import Imaging
from .inversion import Inversion
from .lensing import critical_curves, source_plane_lines


def _source_zoom(
    src: np.ndarray, src_grid: Grid, caus: list[np.ndarray], full: list[float]
) -> list[float]:
    """The source-plane box the source panels show: the caustics and the source's bright
    part (above a tenth of its peak), padded by half their size (at least 0.2"), inside
    the mesh's extent `full`."""
    x, y = (np.asarray(v) for v in src_grid.coordinates())
    finite = np.isfinite(src)
    peak = float(np.max(src[finite])) if finite.any() else 0.0
    bright = finite & (src > 0.1 * peak) if peak > 0 else np.zeros_like(finite)
    px = [x[bright], *(c[:, 0] for c in caus)]
    py = [y[bright], *(c[:, 1] for c in caus)]
    xs, ys = np.concatenate(px), np.concatenate(py)
    if xs.size == 0:
        return full
    cx, cy = 0.5 * (xs.min() + xs.max()), 0.5 * (ys.min() + ys.max())
    half = max(0.75 * max(np.ptp(xs), np.ptp(ys)), 0.2)
    return [
        max(full[0], cx - half),
        min(full[1], cx + half),
        max(full[2], cy - half),
        min(full[3], cy + half),
    ]


def _extent(grid: Grid) -> list[float]:
    ny, nx = grid.shape
    ps, (ox, oy) = grid.pixel_scale, grid.origin
    return [ox - nx * ps / 2, ox + nx * ps / 2, oy - ny * ps / 2, oy + ny * ps / 2]


def asinh_stretch(image: np.ndarray, soft: float, vmax: float) -> np.ndarray:
    """`asinh(image / soft) / asinh(vmax / soft)`: linear below `soft` (use about the noise
    level, so faint arcs show), logarithmic above, 1 at `vmax` (Lupton et al. 2004)."""
    soft = max(float(soft), 1e-30)
    return np.arcsinh(image / soft) / np.arcsinh(max(float(vmax), soft) / soft)


# compiled: run eagerly, a model's hundreds of operations each cost a program of their own
# in every new process
@eqx.filter_jit
def _images(system: LensSystem, imaging: Imaging):
    """The model image and the lensed source's part of it."""
    conv = imaging.convolution
    source_only = dataclasses.replace(system, lens_light=None)
    return system.image(imaging.grid, conv), source_only.image(imaging.grid, conv)


@eqx.filter_jit
def _source_plane_image(system: LensSystem, grid: Grid):
    return system.source_plane_image(grid)


def save_figure(fig, axes, path: str | os.PathLike, title: str = "") -> str:
    """Labels `axes` in arcsec, titles `fig`, writes it to `path` (PNG, in one step: an
    interrupted write leaves the previous file) and closes it; returns the path."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xlabel("x [arcsec]")
        ax.set_ylabel("y [arcsec]")
    if title:
        fig.suptitle(title)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
    return str(path)


def plot_fit(system: LensSystem, imaging: Imaging, path: str | os.PathLike, title: str = "") -> str:
    """Writes a six-panel PNG to `path` of a fit with a parametric source:

    1. the data with the critical curves (cyan), 2. the data minus the lens-light model
    (the arcs), 3. the model of the lensed source alone, 4. the full model, all in an asinh
    stretch (`asinh_stretch`: linear up to the median noise, logarithmic above, so faint
    arcs and the bright lens both show; masked pixels greyed); 5. the normalised residuals
    `(data - model) / noise` on the mask (colour range +-5); 6. the source plane zoomed on
    the caustics (cyan), with the source's surface brightness (flux/arcsec^2).

    Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = imaging.grid
    model, source_only = (np.asarray(a) for a in _images(system, imaging))
    data = np.asarray(imaging.data)
    mask = np.asarray(imaging.mask)
    noise = np.asarray(imaging.noise_map)
    resid = np.where(mask, (data - model) / noise, np.nan)
    fine = Grid((2 * grid.shape[0], 2 * grid.shape[1]), grid.pixel_scale / 2, origin=grid.origin)
    crit = critical_curves(system.mass, fine)
    caus = source_plane_lines(system.mass, crit)
    pts = np.concatenate(caus) if caus else np.zeros((0, 2))
    if len(pts):
        cx, cy = pts.mean(axis=0)
        half = 0.6 * max(np.ptp(pts[:, 0]), np.ptp(pts[:, 1]), 10 * grid.pixel_scale)
    else:
        cx, cy, half = grid.origin[0], grid.origin[1], 0.5
    n = 150
    src_grid = Grid((n, n), 2 * half / n, origin=(float(cx), float(cy)), supersampling=2)
    src = np.asarray(_source_plane_image(system, src_grid))

    soft = float(np.median(noise[mask])) if mask.any() else 1.0
    vmax = float(np.nanpercentile(np.where(mask, data, np.nan), 99.9))
    arcs = data - (model - source_only)
    arcs_max = float(np.nanpercentile(np.where(mask, arcs, np.nan), 99.9))
    ext = _extent(grid)
    fig, axes = plt.subplots(2, 3, figsize=(15, 9.2), constrained_layout=True)
    axes = axes.ravel()
    panels = [
        (axes[0], data, "data (asinh)", vmax),
        (axes[1], arcs, "data - lens light model (asinh)", arcs_max),
        (axes[2], source_only, "model: lensed source alone (asinh)", arcs_max),
        (axes[3], model, "model (asinh)", vmax),
    ]
    for ax, img, label, top in panels:
        ax.set_facecolor("0.85")
        shown = np.where(mask, asinh_stretch(img, soft, top), np.nan)
        im = ax.imshow(shown, origin="lower", extent=ext, cmap="magma", vmin=-0.05, vmax=1.0)
        fig.colorbar(im, ax=ax, shrink=0.8, label=f"asinh(flux / {soft:.2g}), scaled")
        ax.set_title(label)
    ax = axes[4]
    ax.set_facecolor("0.85")
    im = ax.imshow(resid, origin="lower", extent=ext, cmap="RdBu_r", vmin=-5, vmax=5)
    fig.colorbar(im, ax=ax, shrink=0.8, label="(data - model) / noise")
    ax.set_title("normalised residuals")
    for ax in axes[:5]:
        for line in crit:
            ax.plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
        ax.set_xlim(ext[:2])
        ax.set_ylim(ext[2:])
    ax = axes[5]
    im = ax.imshow(src, origin="lower", extent=_extent(src_grid), cmap="magma")
    for line in caus:
        ax.plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
    sext = _extent(src_grid)
    ax.set_xlim(sext[:2])
    ax.set_ylim(sext[2:])
    ax.set_title("source plane and caustics")
    fig.colorbar(im, ax=ax, shrink=0.8, label="flux/arcsec$^2$")
    return save_figure(fig, axes, path, title)


def source_plane_grid(inversion: Inversion, n: int = 120) -> Grid:
    """A square regular grid of `n x n` pixels over the mesh nodes that carry the source
    (the nodes' 1st-99th percentile box, so a few far-traced nodes do not shrink it)."""
    nodes = np.asarray(inversion.geometry.nodes())
    lo = np.percentile(nodes, 1, axis=0)
    hi = np.percentile(nodes, 99, axis=0)
    centre = 0.5 * (lo + hi)
    half = 0.5 * float(max(hi - lo)) * 1.05 or 0.5
    return Grid((n, n), 2 * half / n, origin=(float(centre[0]), float(centre[1])))


def plot_reconstruction(
    system: LensSystem,
    imaging: Imaging,
    inversion: Inversion,
    path: str | os.PathLike,
    title: str = "",
    positions: Float[np.ndarray, "n 2"] | None = None,
) -> str:
    """Writes a six-panel PNG of a pixelized-source fit: the data with the critical curves
    (cyan), the data minus the lens-light model (the arcs), the model of the lensed source
    alone (all three in an asinh stretch, `asinh_stretch`), the normalised residuals
    (colour range +-5), the reconstructed source (interpolated to a regular source-plane
    grid over the mesh, nodes dotted, caustics in cyan; zoomed on the caustics and the
    source's bright part) and its 1-sigma errors
    (`sqrt(diag((F+H)^-1))`). `system` is the fitted model with the solved source filled
    in (`LogEvidence.complete`; `fit_pixelized` returns it so); `inversion` comes from
    `LogEvidence.invert(system, errors=True)`. `positions` (`(n, 2)`, arcsec; e.g. the
    ones the chain held together) are marked with green crosses on the image panels and,
    traced by the fitted mass, on the source panels. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = imaging.grid
    mask = np.asarray(imaging.mask)
    data = np.asarray(imaging.data)
    noise = np.asarray(imaging.noise_map)
    model = np.asarray(inversion.model_image)
    source_only = np.asarray(
        dataclasses.replace(system, lens_light=None).image(grid, imaging.convolution)
    )
    arcs = data - (model - source_only)
    resid = np.where(mask, np.asarray(inversion.residuals), np.nan)
    src_grid = source_plane_grid(inversion)
    src = np.asarray(inversion.source_image(src_grid))
    err = np.asarray(inversion.error_image(src_grid))
    nodes = np.asarray(inversion.geometry.nodes())
    fine = Grid((2 * grid.shape[0], 2 * grid.shape[1]), grid.pixel_scale / 2, origin=grid.origin)
    crit = critical_curves(system.mass, fine)
    caus = source_plane_lines(system.mass, crit)
    sext, ext = _extent(src_grid), _extent(grid)
    zoom = _source_zoom(src, src_grid, caus, sext)
    soft = float(np.median(noise[mask])) if mask.any() else 1.0
    vmax = float(np.nanpercentile(np.where(mask, data, np.nan), 99.9))
    arcs_max = float(np.nanpercentile(np.where(mask, arcs, np.nan), 99.9))
    fig, axes = plt.subplots(2, 3, figsize=(15, 9.2), constrained_layout=True)
    axes = axes.ravel()
    for ax, img, label, top in [
        (axes[0], data, "data (asinh)", vmax),
        (axes[1], arcs, "data - lens light model (asinh)", arcs_max),
        (axes[2], source_only, "model: lensed source alone (asinh)", arcs_max),
    ]:
        ax.set_facecolor("0.85")
        shown = np.where(mask, asinh_stretch(img, soft, top), np.nan)
        im = ax.imshow(shown, origin="lower", extent=ext, cmap="magma", vmin=-0.05, vmax=1.0)
        fig.colorbar(im, ax=ax, shrink=0.8, label=f"asinh(flux / {soft:.2g}), scaled")
        ax.set_title(label)
    axes[3].set_facecolor("0.85")
    im = axes[3].imshow(resid, origin="lower", extent=ext, cmap="RdBu_r", vmin=-5, vmax=5)
    fig.colorbar(im, ax=axes[3], shrink=0.8, label="(data - model) / noise")
    axes[3].set_title("normalised residuals")
    pos = np.zeros((0, 2)) if positions is None else np.asarray(positions, dtype=float)
    dtype = jnp.result_type(float)
    traced = [
        np.asarray(v)
        for v in system.mass.ray_shoot(jnp.asarray(pos[:, 0], dtype), jnp.asarray(pos[:, 1], dtype))
    ]
    for ax in axes[:4]:
        for line in crit:
            ax.plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
        ax.plot(pos[:, 0], pos[:, 1], "x", color="lime", ms=7, mew=1.5)
        ax.set_xlim(ext[:2])
        ax.set_ylim(ext[2:])
    for ax, img, label, cmap in [
        (axes[4], src, "source (flux/arcsec$^2$) and caustics", "magma"),
        (axes[5], err, "source 1-sigma error", "viridis"),
    ]:
        ax.set_facecolor("0.85")
        im = ax.imshow(img, origin="lower", extent=sext, cmap=cmap)
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_title(label)
        ax.plot(nodes[:, 0], nodes[:, 1], ".", color="white", ms=1.0, alpha=0.5)
        for line in caus:
            ax.plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
        ax.plot(traced[0], traced[1], "x", color="lime", ms=7, mew=1.5)
        ax.set_xlim(zoom[:2])
        ax.set_ylim(zoom[2:])
    return save_figure(fig, axes, path, title)
