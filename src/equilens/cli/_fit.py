"""`equilens fit`: one image (`run_fit`) or several bands jointly (`run_fit_multiband`)."""

import os
import sys
import time

from ._parametric import parametric_fit
from ._partial import Partial
from ._source import (
    _pixelized_stage,
    default_mesh,
    make_mesh,
    make_regularization,
    write_source_fits,
)


def run_fit(
    imaging,
    json_path: str,
    mass: str,
    lens_light: str | None,
    source: str,
    solver: str = "lm",
    title: str = "",
    extra: dict | None = None,
    mesh: str | None = None,
    regularization: str = "constant",
    strength: float | None = None,
    max_steps: int | None = None,
    positions=None,
    positions_sigma: float | None = None,
    partial: Partial | None = None,
    power_law: bool = False,
    region=None,
) -> dict[str, str]:
    """Fits `imaging` (`equilens.solve.fit_lens`; with `region`, the whole image's usable
    pixels, the mask then grown to arcs that continue beyond it and the fit repeated,
    `equilens.solve.fit_to_arcs`; for `source="pixelized"` followed by
    `equilens.solve.fit_pixelized`, with its power-law stage when `power_law`),
    prints the parameters with errors, and writes the JSON result to `json_path` and the
    figure next to it (`.png`; pixelized: also `_source.fits`). Returns the output paths
    and, under `"status"`, the final fit's status in words (`"successful"` or why not).
    `partial` keeps each finished stage."""
    import numpy as np

    from ..plot import plot_fit, plot_reconstruction
    from ..solve import fit_lens, fit_to_arcs, result_to_dict, with_earlier_rivals, write_json

    # pixelized: build (and so check) the mesh and regularization before any fitting
    default = mesh is None
    if source == "pixelized" and mesh is None:
        mesh = default_mesh(imaging)
    pix_mesh = make_mesh(mesh, imaging) if mesh is not None and source == "pixelized" else None
    pix_reg = make_regularization(regularization, strength) if source == "pixelized" else None

    t0 = time.perf_counter()
    print(
        f"equilens: fitting {mass} mass, {lens_light or 'no'} lens light, {source} source to "
        f"{imaging.shape[0]}x{imaging.shape[1]} pixels ({int(imaging.mask.sum())} in the mask)"
    )
    # a progress bar per fit when a person is watching (stderr is a terminal)
    progress = sys.stderr.isatty()
    minima: list = []
    result = parametric_fit(
        fit_lens,
        imaging,
        mass,
        lens_light,
        source,
        pixelized=source == "pixelized",
        solver=solver,
        max_steps=max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        progress=progress,
        partial=partial,
        minima=minima if source == "pixelized" else None,
    )
    extra = dict(extra or {})
    if region is not None:
        result, imaging, rounds = fit_to_arcs(
            region,
            imaging,
            result,
            solver=solver,
            max_steps=300 if max_steps is None else max_steps,
            positions=positions,
            positions_sigma=positions_sigma,
            progress=progress,
        )
        added = sum(g.added for g in rounds)
        extra["mask"] = {"pixels": int(np.asarray(imaging.mask).sum()), "added": added}
        if added:
            if partial is not None:
                partial.keep("grown mask", result)
            if pix_mesh is not None:  # the mesh of the grown mask
                mesh = default_mesh(imaging) if default else mesh
                pix_mesh = make_mesh(mesh, imaging)  # pyright: ignore[reportArgumentType]
    folder = os.path.dirname(os.path.abspath(json_path))
    os.makedirs(folder, exist_ok=True)
    base = os.path.splitext(json_path)[0]
    png = base + ".png"
    out = {"json": json_path, "png": png}
    if pix_mesh is not None and pix_reg is not None:
        summary = result_to_dict(result)
        extra["parametric_stage"] = {
            k: summary[k] for k in ("reduced_chi2", "status", "arc_residuals", "components")
        }
        print(f"  pixelized source: {mesh} mesh, {regularization} regularization")
        parametric = result
        result, inversion, stages, held = _pixelized_stage(
            imaging,
            result,
            pix_mesh,
            pix_reg,
            strength,
            solver,
            max_steps,
            positions,
            progress,
            power_law,
            alternatives=minima,
        )
        # rival minima of the parametric fit stay named: the chain explored one of them
        result = with_earlier_rivals(result, parametric, "parametric fit")
        if held is not None:
            extra["positions"] = np.asarray(held).tolist()
        extra["stages"] = stages
        extra["log_evidence"] = float(inversion.log_evidence)
        extra["source_fits"] = base + "_source.fits"
        write_source_fits(base + "_source.fits", inversion)
        plot_reconstruction(result.model, imaging, inversion, png, title=title, positions=held)
        out["source_fits"] = base + "_source.fits"
    else:
        plot_fit(result.model, imaging, png, title=title)
    print(result.table())
    write_json(json_path, result, **extra)
    print(f"  result: {json_path}\n  figure: {png}\n  wall time {time.perf_counter() - t0:.1f} s")
    out["status"] = "successful" if result.success else result.message()
    return out


def run_fit_multiband(
    data,
    json_path: str,
    mass: str,
    lens_light: str | None,
    source: str,
    solver: str = "lm",
    max_steps: int | None = None,
    positions=None,
    positions_sigma: float | None = None,
    mesh: str | None = None,
    regularization: str = "constant",
    strength: float | None = None,
    partial: Partial | None = None,
) -> dict[str, str]:
    """Fits the bands of `data` (a `MultiBandImaging`) jointly
    (`equilens.solve.fit_multiband`; for `source="pixelized"` followed by
    `equilens.solve.fit_multiband_pixelized`), prints the parameters with errors, and
    writes the JSON result (per-band amplitudes and chi2; pixelized: the log-evidence, per
    band too) to `json_path` and one figure per band next to it (`OUT_<band>.png`;
    pixelized: also `OUT_<band>_source.fits`). Returns the output paths and the final
    fit's status in words."""
    import numpy as np

    from ..plot import plot_fit, plot_reconstruction
    from ..solve import auto_positions, fit_multiband, fit_multiband_pixelized, write_json
    from ..terms import GaussianLikelihood

    pixelized = source == "pixelized"
    if pixelized and mesh is None:
        mesh = default_mesh(data.bands[0])
    pix_mesh = make_mesh(mesh, data.bands[0]) if mesh is not None and pixelized else None
    pix_reg = make_regularization(regularization, strength) if pixelized else None
    t0 = time.perf_counter()
    sizes = ", ".join(
        f"{n} {b.shape[0]}x{b.shape[1]} ({int(b.mask.sum())} in the mask)"
        for n, b in zip(data.names, data.bands, strict=True)
    )
    print(
        f"equilens: fitting {mass} mass, {lens_light or 'no'} lens light, {source} source to "
        f"{len(data)} bands: {sizes}"
    )
    progress = sys.stderr.isatty()
    result = parametric_fit(
        fit_multiband,
        data,
        mass,
        lens_light,
        source,
        pixelized=pixelized,
        solver=solver,
        max_steps=max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        progress=progress,
        partial=partial,
    )
    folder = os.path.dirname(os.path.abspath(json_path))
    os.makedirs(folder, exist_ok=True)
    base = os.path.splitext(json_path)[0]
    out = {"json": json_path}
    extra: dict = {}
    inversions = None
    if pix_mesh is not None and pix_reg is not None:
        arcs = result.arc_residuals
        extra["parametric_stage"] = {
            "reduced_chi2": float(result.reduced_chi2),
            "status": result.message(),
            "arc_residuals": None if arcs is None else arcs.to_dict(),
        }
        print(f"  pixelized source in every band: {mesh} mesh, {regularization} regularization")
        held = positions
        if held is None:
            held = auto_positions(data.bands[0], result.model.band(0))
        if held is not None:
            extra["positions"] = np.asarray(held).tolist()
        result, inversions, stages = fit_multiband_pixelized(
            data,
            result.model,
            pix_mesh,
            pix_reg,
            solver=None if solver == "lm" else solver,
            fit_strength=strength is None,
            max_steps=1000 if max_steps is None else max_steps,
            positions=held,
            progress=progress,
        )
        extra["stages"] = stages
        extra["log_evidence"] = stages[-1]["log_evidence"]
    elif positions is not None:
        extra["positions"] = np.asarray(positions).tolist()
    per_band = []
    for k, (name, imaging) in enumerate(zip(data.names, data.bands, strict=True)):
        system = result.model.band(k)
        png = f"{base}_{name}.png"
        entry: dict = {"name": name, "n_data": int(imaging.mask.sum()), "figure": png}
        if inversions is not None:
            fits_path = f"{base}_{name}_source.fits"
            write_source_fits(fits_path, inversions[k])
            plot_reconstruction(system, imaging, inversions[k], png, title=f"band {name}")
            entry["log_evidence"] = float(inversions[k].log_evidence)
            entry["chi2"] = float(inversions[k].chi2)
            entry["source_fits"] = fits_path
            out[f"source_fits_{name}"] = fits_path
        else:
            plot_fit(system, imaging, png, title=f"band {name}: {mass} mass, {source} source")
            # (the amplitudes are the fit's: nothing solved again)
            entry["chi2"] = float(GaussianLikelihood(imaging, linear=False).chi2(system))
        per_band.append(entry)
        out[f"png_{name}"] = png
    print(result.table())
    for b in per_band:
        print(f"  band {b['name']}: chi2 {b['chi2']:.1f} over {b['n_data']} pixels")
    write_json(json_path, result, data.names, bands=per_band, **extra)
    print(f"  result: {json_path}\n  wall time {time.perf_counter() - t0:.1f} s")
    out["status"] = "successful" if result.success else result.message()
    return out
