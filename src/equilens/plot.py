"""Figures (matplotlib, imported lazily): a fit's data, model, residuals and source."""

import os

import numpy as np

from ._grid import Grid
from ._lens_system import LensSystem
from .data import Imaging
from .lensing import caustics, critical_curves
from .source import Inversion


def _extent(grid: Grid) -> list[float]:
    ny, nx = grid.shape
    ps, (ox, oy) = grid.pixel_scale, grid.origin
    return [ox - nx * ps / 2, ox + nx * ps / 2, oy - ny * ps / 2, oy + ny * ps / 2]


def plot_fit(system: LensSystem, imaging: Imaging, path: str | os.PathLike, title: str = "") -> str:
    """Writes a four-panel PNG to `path`: the data (masked pixels greyed) with the critical
    curves, the model image, the normalised residuals `(data - model) / noise` on the mask
    (colour range +-5), and the source-plane surface brightness with the caustics. Returns
    the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = imaging.grid
    model = np.asarray(system.image(grid, imaging.convolution))
    data = np.asarray(imaging.data)
    mask = np.asarray(imaging.mask)
    resid = np.where(mask, (data - model) / np.asarray(imaging.noise_map), np.nan)
    fine = Grid((2 * grid.shape[0], 2 * grid.shape[1]), grid.pixel_scale / 2, origin=grid.origin)
    crit = critical_curves(system.mass, fine)
    caus = caustics(system.mass, fine)
    pts = np.concatenate(caus) if caus else np.zeros((0, 2))
    if len(pts):
        cx, cy = pts.mean(axis=0)
        half = 0.6 * max(np.ptp(pts[:, 0]), np.ptp(pts[:, 1]), 10 * grid.pixel_scale)
    else:
        cx, cy, half = grid.origin[0], grid.origin[1], 0.5
    n = 150
    src_grid = Grid((n, n), 2 * half / n, origin=(float(cx), float(cy)), supersampling=2)
    src = np.asarray(system.source_plane_image(src_grid))

    vmax = np.nanpercentile(np.where(mask, data, np.nan), 99.5)
    ext = _extent(grid)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4), constrained_layout=True)
    shown = np.where(mask, data, np.nan)
    panels = [
        (axes[0], shown, "data (flux/pixel)", "magma", (0, vmax)),
        (axes[1], np.where(mask, model, np.nan), "model", "magma", (0, vmax)),
        (axes[2], resid, "normalised residuals", "RdBu_r", (-5, 5)),
    ]
    for ax, img, label, cmap, (lo, hi) in panels:
        ax.set_facecolor("0.85")
        im = ax.imshow(img, origin="lower", extent=ext, cmap=cmap, vmin=lo, vmax=hi)
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_title(label)
    for ax in axes[:2]:
        for line in crit:
            ax.plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
        ax.set_xlim(ext[:2])
        ax.set_ylim(ext[2:])
    im = axes[3].imshow(src, origin="lower", extent=_extent(src_grid), cmap="magma")
    for line in caus:
        axes[3].plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
    sext = _extent(src_grid)
    axes[3].set_xlim(sext[:2])
    axes[3].set_ylim(sext[2:])
    axes[3].set_title("source (flux/arcsec$^2$) and caustics")
    fig.colorbar(im, ax=axes[3], shrink=0.8)
    for ax in axes:
        ax.set_xlabel("x [arcsec]")
        ax.set_ylabel("y [arcsec]")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


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
) -> str:
    """Writes a four-panel PNG of a pixelized-source fit: the reconstructed source
    (interpolated to a regular source-plane grid, mesh nodes dotted, caustics in cyan), its
    1-sigma errors (`sqrt(diag((F+H)^-1))`), the model image and the normalised residuals
    (colour range +-5). `inversion` comes from `LogEvidence.invert(system, errors=True)`.
    Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = imaging.grid
    mask = np.asarray(imaging.mask)
    model = np.asarray(inversion.model_image)
    resid = np.where(mask, np.asarray(inversion.residuals), np.nan)
    src_grid = source_plane_grid(inversion)
    src = np.asarray(inversion.source_image(src_grid))
    err = np.asarray(inversion.error_image(src_grid))
    nodes = np.asarray(inversion.geometry.nodes())
    fine = Grid((2 * grid.shape[0], 2 * grid.shape[1]), grid.pixel_scale / 2, origin=grid.origin)
    caus = caustics(system.mass, fine)
    sext, ext = _extent(src_grid), _extent(grid)
    vmax = np.nanpercentile(np.where(mask, np.asarray(imaging.data), np.nan), 99.5)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4), constrained_layout=True)
    panels = [
        (axes[0], src, sext, "source (flux/arcsec$^2$)", "magma", None),
        (axes[1], err, sext, "source 1-sigma error", "viridis", None),
        (axes[2], np.where(mask, model, np.nan), ext, "model image", "magma", (0, vmax)),
        (axes[3], resid, ext, "normalised residuals", "RdBu_r", (-5, 5)),
    ]
    for ax, img, extent, label, cmap, lim in panels:
        ax.set_facecolor("0.85")
        lo, hi = lim if lim is not None else (None, None)
        im = ax.imshow(img, origin="lower", extent=extent, cmap=cmap, vmin=lo, vmax=hi)
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_title(label)
        ax.set_xlabel("x [arcsec]")
        ax.set_ylabel("y [arcsec]")
    for ax in axes[:2]:
        ax.plot(nodes[:, 0], nodes[:, 1], ".", color="white", ms=1.0, alpha=0.5)
        for line in caus:
            ax.plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
        ax.set_xlim(sext[:2])
        ax.set_ylim(sext[2:])
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
