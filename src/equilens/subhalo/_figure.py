"""The subhalo scan's figure: the Delta log-evidence map over the data, and the residuals
without and with the best cell's subhalo."""

import os

import equinox as eqx
import numpy as np

from .._grid import Grid
from ..lensing import critical_curves
from ..objective import Objective
from ._scan import SubhaloScan


@eqx.filter_jit
def _model_image(term, model):
    return term.model_image(model)


def plot_subhalo_scan(
    scan: SubhaloScan, objective: Objective, path: str | os.PathLike, title: str = ""
) -> str:
    """Writes a three-panel PNG to `path`: 1. the data (asinh stretch) with each cell's `Delta log
    E` (the subhalo model's log-evidence minus the smooth model's) as a translucent square (the
    refined cell's sub-cells outlined in yellow with theirs), the best subhalo (cross) and the best
    model's critical curves (cyan); 2. and 3. the normalised residuals `(data - model) / noise` of
    the smooth model and of the best cell's model (colour range +-5). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.patches import Rectangle

    from ..plot import _extent, asinh_stretch, save_figure

    term = objective.imaging_terms()[0]
    im = term.imaging
    data, noise = np.asarray(im.data), np.asarray(im.noise_map)
    mask = np.asarray(im.mask)
    ext = _extent(im.grid)
    best_model = scan.best_fit
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4), constrained_layout=True)
    ax = axes[0]
    soft = float(np.median(noise[mask])) if mask.any() else 1.0
    vmax = float(np.nanpercentile(np.where(mask, data, np.nan), 99.9))
    ax.imshow(asinh_stretch(data, soft, vmax), origin="lower", extent=ext, cmap="gray")
    delta = np.asarray(scan.delta_log_evidence, np.float64)
    finite = np.isfinite(delta)
    top = max(float(np.max(np.abs(delta[finite]))) if finite.any() else 1.0, 1.0)
    cmap = plt.get_cmap("RdBu_r")
    for (cx, cy), d in zip(scan.centres, delta, strict=True):
        color = cmap(0.5 + 0.5 * float(d) / top) if np.isfinite(d) else (0.5, 0.5, 0.5, 1.0)
        ax.add_patch(
            Rectangle(
                (cx - scan.half, cy - scan.half),
                2 * scan.half,
                2 * scan.half,
                facecolor=color,
                alpha=0.45,
                edgecolor="white",
                lw=0.4,
            )
        )
        label = f"{d:.0f}" if np.isfinite(d) else "failed"
        ax.text(cx, cy, label, ha="center", va="center", fontsize=7, color="white")
    sub = scan.refinement
    if sub is not None:  # the refined cell's sub-cells: outlines and their values
        for (cx, cy), d in zip(sub.centres, sub.delta_log_evidence, strict=True):
            ax.add_patch(
                Rectangle(
                    (cx - sub.half, cy - sub.half),
                    2 * sub.half,
                    2 * sub.half,
                    facecolor="none",
                    edgecolor="yellow",
                    lw=0.5,
                )
            )
            label = f"{d:.0f}" if np.isfinite(d) else "failed"
            ax.text(cx, cy - 0.6 * sub.half, label, ha="center", fontsize=5, color="yellow")
    sm = ScalarMappable(cmap=cmap, norm=Normalize(-top, top))
    fig.colorbar(sm, ax=ax, shrink=0.8, label="Delta log E (subhalo - smooth)")
    if best_model is not None:
        fine = Grid((2 * im.shape[0], 2 * im.shape[1]), im.pixel_scale / 2, origin=im.grid.origin)
        for line in critical_curves(best_model.mass, fine):
            ax.plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
        ax.plot(scan.best["center_x"], scan.best["center_y"], "x", color="yellow", ms=10, mew=2)
    ax.set_xlim(ext[:2])
    ax.set_ylim(ext[2:])
    ax.set_title("data and Delta log-evidence per cell")
    for ax, model, label in (
        (axes[1], scan.smooth, "residuals: smooth model"),
        (axes[2], best_model, "residuals: with the best subhalo"),
    ):
        ax.set_facecolor("0.85")
        if model is not None:
            image = np.asarray(_model_image(term, model))
            resid = np.where(mask, (data - image) / noise, np.nan)
            shown = ax.imshow(resid, origin="lower", extent=ext, cmap="RdBu_r", vmin=-5, vmax=5)
            fig.colorbar(shown, ax=ax, shrink=0.8, label="(data - model) / noise")
        ax.set_title(label)
    return save_figure(fig, axes, path, title)
