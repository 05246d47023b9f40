"""The `equilens` command.

`equilens demo [--output DIR] [--solver NAME]` fits the HST image of SDSS J0946+1006 shipped
with the package (SIE + external shear, multi-Gaussian lens light, Sersic source with linear
amplitudes, 3" circular mask, 2x2 supersampling, generic start) and writes `demo.json` and
`demo.png` to DIR (default `equilens_demo`).

`equilens fit IMAGE.fits --noise-map NOISE.fits --psf PSF.fits --pixel-scale 0.05
[--exclude-mask MASK.fits] [--mask-radius R] --mass sie+shear [--lens-light mge|sersic|none]
--source sersic --json OUT.json` fits a user's data the same way (`equilens.solve.fit_lens`:
a Sersic source that leaves arcs gets a second Sersic when the Bayesian information
criterion prefers it) and writes OUT.json and a PNG next to it. With `--source pixelized
[--mesh rectangular[:NYxNX]|adaptive[:NYxNX]|delaunay[:N]]
[--regularization constant|curvature|adaptive|matern]
[--regularization-strength L]` the parametric fit is followed by a pixelized-source fit that
maximises the Bayesian evidence (strength fitted unless given; the lens light refitted
beside the source; with `--power-law`, last, an SIE's slope freed and the power law kept
when the evidence prefers it); the JSON adds `log_evidence`, the stages' records
and the source-plane reconstruction is written as OUT_source.fits (HDU 0 the source in
flux/arcsec^2, HDU 1 its 1-sigma errors). `--lens-light` defaults to `mge` (a linear
multi-Gaussian expansion); `none` is for data with the lens light removed. `--positions
FILE` (x y in arcsec per line: the multiple images of one source point) adds a positions
penalty (`--positions-sigma`, default a pixel). The pixelized chain holds the images of one
source point together in the source plane (a `PositionsThreshold`): the `--positions`, or
else the images of the parametric source's centre.

Several bands are fitted jointly with `--band IMAGE NOISE PSF` once per band (instead of
IMAGE, --noise-map and --psf; paths may name a FITS extension, `cutout.fits[VIS_FLUX]`),
`--pixel-scale` for all bands or `--band-pixel-scales 0.1,0.1,...` one per band,
`--band-names VIS,Y,...`; `--mask` and `--mask-radius` apply to every band. One mass model,
the lens light and source shared in shape with per-band amplitudes
(`equilens.solve.fit_multiband`: the first band is fitted alone first, then all jointly);
the JSON names each light component's band and lists each band's chi2, and one figure per
band is written (OUT_<band>.png). With `--source pixelized` the joint parametric fit is
followed by a pixelized source in every band, on one mesh (built on the first band) with a
regularization strength per band, fitted by the sum of the bands' evidences
(`equilens.solve.fit_multiband_pixelized`; OUT_<band>_source.fits per band).

`equilens sample IMAGE.fits --noise-map ... --psf ... --pixel-scale ... [--sampler auto]
[--chains 4] [--warmup 500] [--samples N] [--seed 0] --json OUT.json` (the data and model
options as for `fit`, `--band` included: several bands are fitted, then sampled jointly;
with `--source pixelized`, the mass's parameters are sampled with the source marginalised by
the evidence (each band's), the regularization held as fitted) fits, then samples the
posterior from the fit (`pip install equilens[sampling]`): with NUTS chains
(`equilens.sample`; `--samples` draws per chain, default 1000; `--max-tree-depth`, default
10, 6 for a pixelized source) or, with `--sampler nested`, nautilus on the Numba likelihood
in one worker process per CPU core (`equilens.nested_sample`; uniform priors on the fit +-
`--prior-width` (10) errors inside the class bounds, `--live` points (300), `--networks` per
bound (2), `--samples` effective samples (4000), progress every 10 s with an estimate of the
time left), which also gives the log-evidence. `--sampler auto` (the default) is nested
sampling when JAX runs on the CPU (and Numba and nautilus are installed), NUTS on an
accelerator; the choice is printed. Ctrl-C while sampling writes the draws so far (status
"interrupted"; nested sampling stops after its batch, NUTS after its chunk of draws, a
twentieth of them; a second Ctrl-C stops at once) and exits 130. OUT.json holds the fit and,
per parameter, the posterior `mean`, `std`, `p16`, `p50`, `p84` (NUTS: `ess`, `rhat`;
nested: the prior interval, and `log_evidence` with its error); the draws are written as
NetCDF (OUT.nc, ArviZ) and a corner plot as OUT_corner.png; exit status 2 when NUTS did not
converge (an R-hat at or above 1.01, or divergent transitions) or nested sampling stopped
short of its samples.

`--check` (fit and sample) checks every input and option, prints what would be fitted
and exits with status 0 without fitting or writing anything. Errors are one
line on stderr and exit status 1; a fit that did not converge, or converged to an
implausible model (a parameter at a bound, a source larger than the data), writes its
results, says why on stderr and exits with status 2.
"""

import argparse
import math
import os
import sys
import time
import warnings
from typing import Any

from ._cli_sample import choose_sampler as choose_sampler, run_sample
from ._files import atomic_path

DEMO_MASK_RADIUS = 3.0  # arcsec: the lens and the inner ring of SDSS J0946+1006
DEMO_SUPERSAMPLING = 2  # the source is compact (R ~ 0.1"): 2x2 sub-pixels per pixel
MAX_SUPERSAMPLING = 32  # sub-pixels per pixel side: beyond it a typo, not a model
MAX_COUNT = 2**31 - 1  # steps, chains, draws, live points: int32 on the device


def _load(
    image: str,
    noise_map: str,
    psf: str,
    pixel_scale: float,
    exclude: str | None,
    radius: float | None,
    supersampling: int,
):
    from . import Imaging

    if not (math.isfinite(pixel_scale) and pixel_scale > 0):
        raise ValueError(f"--pixel-scale must be > 0 arcsec, got {pixel_scale}")
    if radius is not None and not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"--mask-radius must be > 0 arcsec, got {radius}")
    # the radius joins the mask before the data are checked: only the pixels the fit uses
    # must be finite with positive noise (a cutout's NaN border outside it is ignored)
    full = Imaging.from_fits(
        image,
        noise_map,
        psf,
        pixel_scale,
        exclude_mask=exclude,
        supersampling=supersampling,
        mask_radius=radius,
    )
    if full.ignored_bad_pixels:
        print(
            f"  {image}: {full.ignored_bad_pixels} bad pixels (NaN, inf or noise <= 0) "
            "outside the mask, ignored"
        )
    return full.cropped()


def _positions(path: str | None):
    """The `--positions` file: two columns, x and y in arcsec ('#' starts a comment)."""
    if path is None:
        return None
    import numpy as np

    from .solve._pipeline import _checked_positions

    if not os.path.exists(path):
        raise ValueError(f"positions file not found: {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy only warns about an empty file
            pos = np.loadtxt(path, ndmin=2)
    except (ValueError, UserWarning) as err:
        raise ValueError(f"cannot read --positions {path}: {err}") from None
    try:
        return _checked_positions(pos)
    except ValueError as err:
        raise ValueError(f"--positions {path}: two columns (x y), >= 2 rows: {err}") from None


MESHES = ("rectangular", "adaptive", "delaunay")
REGULARIZATIONS = ("constant", "curvature", "adaptive", "matern")
DEFAULT_MESH_SHAPE = {"rectangular": (32, 32), "adaptive": (24, 24)}
#: The pixelized source's mesh when `--mesh` is not given: a mesh adapted to the
#: magnification puts its pixels where the arcs resolve the source (on the realistic
#: suite's bright arcs, log-evidence +2,300 over the 32x32 rectangular mesh at the same
#: number of pixels and cost) ...
DEFAULT_MESH = "adaptive:32x32"
#: ... with at most this many source pixels per pixel of the mask (`default_mesh`: a
#: smaller square mesh on a small mask, e.g. a Euclid cutout of a 1" lens)
DEFAULT_MESH_FILL = 0.5


def default_mesh(imaging) -> str:
    """The `--mesh` spec used when none is given: `DEFAULT_MESH`, or on a mask of fewer than
    2,048 pixels an adaptive NxN mesh of at most `DEFAULT_MESH_FILL` source pixels per
    masked pixel (an evidence needs more data than source pixels). Raises `ValueError` for
    a mask too small for a pixelized source (under 128 pixels: an 8x8 mesh)."""
    import math

    import numpy as np

    n = int(np.asarray(imaging.mask).sum())
    side = min(32, math.isqrt(int(n * DEFAULT_MESH_FILL)))
    if side < 8:
        raise ValueError(
            f"the mask has {n} pixels: too few for a pixelized source (at least 128, for an "
            "8x8 mesh); use a larger --mask-radius"
        )
    return DEFAULT_MESH if side == 32 else f"adaptive:{side}x{side}"


DEFAULT_DELAUNAY_NODES = 500


def make_mesh(spec: str, imaging):
    """A source mesh from a command-line spec: `rectangular[:NYxNX]`, `adaptive[:NYxNX]` or
    `delaunay[:N]` (N nodes picked evenly over the mask)."""
    import numpy as np

    from .source import AdaptiveRectangularMesh, DelaunayMesh, RectangularMesh

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
        return RectangularMesh(shape) if kind == "rectangular" else AdaptiveRectangularMesh(shape)
    except ValueError as err:
        raise ValueError(f"bad --mesh {spec!r}: {err}") from None


def make_regularization(name: str, strength: float | None):
    """A regularization from its command-line name, at `strength` (default 1)."""
    from .regularization import (
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

    from .plot import source_plane_grid

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


class Partial:
    """What a run has finished, for an interrupted run (Ctrl-C) to write: the latest
    stage's `FitResult` as the pipeline hands it over (`keep`, the pipelines' `on_stage`),
    written by `write` as the JSON of a fit with `"status": "interrupted"`."""

    def __init__(self, json_path: str | None) -> None:
        self.json_path = json_path
        self.stage: str | None = None
        self.result: Any = None
        self.band_names: Any = None
        #: set when the run wrote its interrupted result itself (`equilens sample`)
        self.written: str | None = None

    def keep(self, stage: str, result: Any) -> None:
        self.stage, self.result = stage, result

    def write(self) -> str | None:
        """Writes the kept result (None when there is none, or no path); returns the path."""
        if self.written is not None:
            return self.written
        if self.result is None or self.json_path is None:
            return None
        from .solve import write_json

        folder = os.path.dirname(os.path.abspath(self.json_path))
        os.makedirs(folder, exist_ok=True)
        write_json(
            self.json_path,
            self.result,
            self.band_names,
            interrupted=True,
            status=f"interrupted: the result of the pipeline's stage {self.stage!r}",
        )
        return self.json_path


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
) -> dict[str, str]:
    """Fits `imaging` (`equilens.solve.fit_lens`; for `source="pixelized"` followed by
    `equilens.solve.fit_pixelized`, with its power-law stage when `power_law`),
    prints the parameters with errors, and writes the JSON result to `json_path` and the
    figure next to it (`.png`; pixelized: also `_source.fits`). Returns the output paths
    and, under `"status"`, the final fit's status in words (`"successful"` or why not).
    `partial` keeps each finished stage."""
    import numpy as np

    from .plot import plot_fit, plot_reconstruction
    from .solve import fit_lens, result_to_dict, write_json

    # pixelized: build (and so check) the mesh and regularization before any fitting
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
    parametric = "sersic" if source == "pixelized" else source
    result = fit_lens(
        imaging,
        mass,
        lens_light,
        parametric,
        solver=solver,
        max_steps=300 if max_steps is None else max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        progress=progress,
        on_stage=None if partial is None else partial.keep,
        # the pixelized chain describes the source itself: it starts from one Sersic
        second_source=source != "pixelized",
    )
    extra = dict(extra or {})
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
        )
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
) -> tuple[Any, Any, list, Any]:
    """`fit_pixelized` from a parametric fit (its mass and lens light, the lens light held),
    as `equilens fit --source pixelized` runs it: the regularization's strength fitted
    unless `strength` is given, the images of one source point held together (the given
    `positions`, or the images of the parametric source's centre), the power-law stage
    when `power_law`. Returns the result, the inversion, the stage records and the
    held positions (or None)."""
    from .solve import auto_positions, fit_pixelized, pixelized_model

    held = positions if positions is not None else auto_positions(imaging, parametric.model)
    start = pixelized_model(parametric.model, mesh, regularization)
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
    )
    return result, inversion, stages, held


def _imaging(args) -> Any:
    """The one-image dataset of `fit`'s and `sample`'s arguments."""
    return _load(
        args.image,
        args.noise_map,
        args.psf,
        args.pixel_scale,
        args.mask,
        args.mask_radius,
        args.supersampling,
    )


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

    from .plot import plot_fit, plot_reconstruction
    from .solve import auto_positions, fit_multiband, fit_multiband_pixelized, write_json
    from .terms import GaussianLikelihood

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
    result = fit_multiband(
        data,
        mass,
        lens_light,
        "sersic" if pixelized else source,
        solver=solver,
        max_steps=300 if max_steps is None else max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        progress=progress,
        on_stage=None if partial is None else partial.keep,
        second_source=not pixelized,
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


def _bands(args):
    """The `--band IMAGE NOISE PSF` options as a `MultiBandImaging`."""
    from .data import MultiBandImaging

    if args.image is not None or args.noise_map is not None or args.psf is not None:
        raise ValueError("give either IMAGE with --noise-map and --psf, or --band once per band")
    n = len(args.band)
    names = [f"band{k}" for k in range(n)]
    if args.band_names is not None:
        names = [v.strip() for v in args.band_names.split(",")]
        if len(names) != n:
            raise ValueError(f"--band-names lists {len(names)} names for {n} bands")
    if args.band_pixel_scales is not None:
        try:
            scales = [float(v) for v in args.band_pixel_scales.split(",")]
        except ValueError:
            raise ValueError(
                f"--band-pixel-scales must be numbers, got {args.band_pixel_scales!r}"
            ) from None
        if len(scales) != n:
            raise ValueError(f"--band-pixel-scales lists {len(scales)} scales for {n} bands")
    elif args.pixel_scale is not None:
        scales = [args.pixel_scale] * n
    else:
        raise ValueError("give --pixel-scale (all bands) or --band-pixel-scales (one per band)")
    bands = []
    for name, (image, noise, psf), scale in zip(names, args.band, scales, strict=True):
        try:
            bands.append(
                _load(image, noise, psf, scale, args.mask, args.mask_radius, args.supersampling)
            )
        except ValueError as err:
            raise ValueError(f"band {name}: {err}") from None
    return MultiBandImaging(bands, names)


def demo_imaging():
    """The demo's data: the shipped HST image of SDSS J0946+1006 with its noise map and
    PSF, 0.05" pixels, its mask of other galaxies, a 3" circular mask, 2x2 supersampling."""
    from importlib.resources import files

    folder = files("equilens") / "_data" / "SDSSJ0946+1006"
    return _load(
        str(folder / "image.fits"),
        str(folder / "noise_map.fits"),
        str(folder / "psf.fits"),
        0.05,
        str(folder / "mask_extra_galaxies.fits"),
        DEMO_MASK_RADIUS,
        DEMO_SUPERSAMPLING,
    )


def run_demo(output: str, solver: str = "lm", partial: Partial | None = None) -> dict[str, str]:
    """Fits the shipped HST image of SDSS J0946+1006; returns the output paths."""
    imaging = demo_imaging()
    out = run_fit(
        imaging,
        os.path.join(output, "demo.json"),
        "sie+shear",
        "mge",
        "sersic",
        solver,
        title="SDSS J0946+1006 (HST F814W): SIE + shear, MGE lens light, Sersic source",
        extra={
            "data": "SDSS J0946+1006, HST ACS F814W (see equilens/_data/SDSSJ0946+1006)",
            "published_theta_E": 1.38,
        },
        partial=partial,
    )
    return out


def _data_options(parser: argparse.ArgumentParser, what: str) -> None:
    """The data options of `fit` and `sample`: one image, or `--band` once per band."""
    parser.add_argument("image", nargs="?", help="image FITS file (flux per pixel)")
    parser.add_argument("--noise-map", help="1-sigma noise FITS file")
    parser.add_argument("--psf", help="PSF kernel FITS file (odd-sized)")
    parser.add_argument("--pixel-scale", type=float, help="arcsec per pixel")
    parser.add_argument(
        "--band",
        nargs=3,
        action="append",
        metavar=("IMAGE", "NOISE", "PSF"),
        help=f"one band of a joint multi-band {what} (repeat per band, sharpest or deepest "
        "first: it is the reference); FITS paths may name an extension, file.fits[NAME]",
    )
    parser.add_argument("--band-names", help="comma-separated names of the --band options")
    parser.add_argument(
        "--band-pixel-scales", help="comma-separated arcsec per pixel, one per --band"
    )
    parser.add_argument(
        "--exclude-mask",
        "--mask",
        dest="mask",
        help="FITS file, non-zero = pixel excluded (--mask: the same; the API's mask= is "
        "True = used)",
    )
    parser.add_argument(
        "--mask-radius", type=float, help="use pixels within R arcsec of the centre"
    )


def _common_options(parser: argparse.ArgumentParser) -> None:
    """The options `fit` and `sample` share after the data's."""
    parser.add_argument(
        "--mesh",
        help="pixelized source mesh: adaptive[:NYxNX] (default adaptive:32x32; on a mask of "
        "under 2048 pixels, NxN with N^2 at most half its pixels), rectangular[:NYxNX], "
        "delaunay[:N]",
    )
    parser.add_argument(
        "--regularization",
        help="pixelized: " + "|".join(REGULARIZATIONS) + " (default constant)",
    )
    parser.add_argument(
        "--regularization-strength",
        type=float,
        default=None,
        help="pixelized: fixed strength (default: fitted by the evidence)",
    )
    parser.add_argument(
        "--power-law",
        action="store_true",
        help="pixelized, one band: a last stage that frees an SIE's slope and keeps the "
        "power law when the log-evidence rises by more than 5",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the inputs and the model options, print what would be fitted and exit "
        "(status 0 when valid) without fitting",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="equilens", description="equilens: strong gravitational lens modelling"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit the shipped HST image of SDSS J0946+1006")
    demo.add_argument("--output", default="equilens_demo", help="output folder")
    demo.add_argument("--solver", default="lm", help="solver name (lm, bfgs, lbfgs, adam)")
    fit = sub.add_parser("fit", help="fit a lens model to your own imaging data")
    _data_options(fit, "fit")
    fit.add_argument("--mass", default="sie+shear", help="mass profiles, '+'-joined")
    fit.add_argument(
        "--lens-light",
        default="mge",
        help="lens light profiles, '+'-joined (default mge: a linear multi-Gaussian "
        "expansion; sersic+sersic: a double Sersic); none for data with the lens removed",
    )
    fit.add_argument("--source", default="sersic", help="source light profiles, or 'pixelized'")
    _common_options(fit)
    fit.add_argument(
        "--supersampling",
        type=int,
        default=1,
        help="sub-pixels per pixel side (1 to 32; the global search evaluates the pixel "
        "centres only, the final fit this)",
    )
    fit.add_argument("--solver", default="lm", help="solver name (lm, bfgs, lbfgs, adam)")
    fit.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="solver steps at most, per fit (default 300 per parametric fit, 1000 per "
        "evidence fit of the pixelized chain)",
    )
    fit.add_argument(
        "--positions",
        help="text file: x y (arcsec, one line per multiple image of one source point); "
        "adds a positions penalty to the parametric fit, and holds them together in the "
        "pixelized chain (default there: the images of the parametric source's centre)",
    )
    fit.add_argument(
        "--positions-sigma", type=float, help="1-sigma of the positions (arcsec; default a pixel)"
    )
    fit.add_argument("--json", required=True, help="output JSON path (PNG written beside it)")
    smp = sub.add_parser(
        "sample",
        help="fit, then draw the posterior with NUTS or nested sampling (pip install "
        "equilens[sampling])",
        description="Fits the data as `equilens fit` does (one image, or --band once per "
        "band: the bands sampled jointly), then samples the posterior from "
        "the fit: --sampler nuts (blackjax NUTS chains on the device, --chains, "
        "--warmup, --samples draws per chain, --max-tree-depth; R-hat and ESS) or --sampler "
        "nested (nautilus on the Numba likelihood in one process per CPU core, --live "
        "points, --samples effective samples, a uniform prior of --prior-width errors around "
        "the fit; also the log-evidence; progress with the time left). --sampler auto "
        "(default): nested on a CPU, NUTS on an accelerator. Writes OUT.json, the draws as "
        "NetCDF and a corner plot; Ctrl-C while sampling writes the draws so far.",
    )
    _data_options(smp, "sample")
    smp.add_argument("--mass", default="sie+shear", help="mass profiles, '+'-joined")
    smp.add_argument("--lens-light", default="mge", help="lens light profiles, or none")
    smp.add_argument("--source", default="sersic", help="source light profiles, or 'pixelized'")
    _common_options(smp)
    smp.add_argument(
        "--supersampling", type=int, default=1, help="sub-pixels per pixel side (1 to 32)"
    )
    smp.add_argument("--solver", default="lm", help="solver of the fit the chains start from")
    smp.add_argument("--max-steps", type=int, default=None, help="solver steps per fit")
    smp.add_argument("--positions", help="text file: x y of the multiple images (arcsec)")
    smp.add_argument("--positions-sigma", type=float, help="1-sigma of the positions (arcsec)")
    smp.add_argument(
        "--sampler",
        default="auto",
        choices=["auto", "nuts", "nested"],
        help="nuts (blackjax NUTS chains on device), nested (nautilus on the Numba "
        "likelihood: the posterior and the log-evidence) or auto (default: nested on a CPU, "
        "NUTS on an accelerator)",
    )
    smp.add_argument(
        "--chains",
        type=int,
        default=4,
        help="NUTS chains (vmapped; one after another for a pixelized source on a CPU)",
    )
    smp.add_argument(
        "--max-tree-depth",
        type=int,
        default=None,
        help="NUTS: at most 2^D leapfrog steps per draw (default 10; 6 with --source "
        "pixelized, whose evidence is smooth only piecewise)",
    )
    smp.add_argument("--warmup", type=int, default=500, help="window-adaptation steps per chain")
    smp.add_argument(
        "--samples",
        type=int,
        default=None,
        help="NUTS: draws kept per chain (default 1000); nested: effective samples to reach "
        "(default 4000)",
    )
    smp.add_argument(
        "--live",
        type=int,
        default=300,
        help="nested: nautilus live points (default 300; more for a posterior with several modes)",
    )
    smp.add_argument(
        "--networks",
        type=int,
        default=2,
        help="nested: neural networks per nautilus bound (default 2; training them is most "
        "of nautilus's own time)",
    )
    smp.add_argument(
        "--prior-width",
        type=float,
        default=10.0,
        help="nested: uniform prior on the fit +- this many of its 1-sigma errors, inside "
        "the class bounds (default 10)",
    )
    smp.add_argument("--seed", type=int, default=0, help="random seed")
    smp.add_argument(
        "--json", required=True, help="output JSON path (NetCDF draws, corner plot beside it)"
    )
    args = parser.parse_args(argv)
    if args.command != "demo":
        args.source = args.source.strip().lower()

    import jax

    jax.config.update("jax_enable_x64", True)
    if args.command == "demo":
        partial = Partial(os.path.join(args.output, "demo.json"))
    else:
        partial = Partial(args.json)
    try:
        return _run(args, partial)
    except KeyboardInterrupt:
        # Ctrl-C: one line, what was finished written, the shell's status for SIGINT
        written = partial.write()
        kept = (
            f"; the result of stage {partial.stage!r} written to {written}"
            if written
            else "; nothing finished to write"
        )
        print(f"equilens: interrupted{kept}", file=sys.stderr)
        return 130


def _run(args, partial: Partial) -> int:
    """`main` after the arguments are parsed: the command run, errors as one line."""
    try:
        if args.command == "demo":
            _check_solver(args.solver)
            return _exit(run_demo(args.output, args.solver, partial))
        _check_numbers(args)
        positions = _positions(args.positions)
        if args.band:
            data = _bands(args)
            first = data.bands[0]
            partial.band_names = data.names
        else:
            for option, value in (
                ("IMAGE", args.image),
                ("--noise-map", args.noise_map),
                ("--psf", args.psf),
                ("--pixel-scale", args.pixel_scale),
            ):
                if value is None:
                    raise ValueError(f"{option} is required (or --band once per band)")
            data = first = _imaging(args)
        plan = _check_model(args, first, positions)
        if data is not first:
            plan.insert(0, f"{len(data)} bands ({', '.join(data.names)}); the first:")
        if args.check:
            print(f"equilens {args.command}: the inputs are valid (--check: nothing fitted)")
            print("\n".join(f"  {line}" for line in plan))
            return 0
        mesh = args.mesh  # None: default_mesh of the data
        regularization = "constant" if args.regularization is None else args.regularization
        lens_light = _lens_light(args)
        if args.command == "sample":
            out = run_sample(
                data,
                args.json,
                args.mass,
                lens_light,
                args.source,
                n_chains=args.chains,
                n_warmup=args.warmup,
                n_samples=args.samples,
                seed=args.seed,
                solver=args.solver,
                max_steps=args.max_steps,
                positions=positions,
                positions_sigma=args.positions_sigma,
                sampler=args.sampler,
                n_live=args.live,
                n_networks=args.networks,
                prior_width=args.prior_width,
                mesh=mesh,
                regularization=regularization,
                strength=args.regularization_strength,
                max_tree_depth=args.max_tree_depth,
                partial=partial,
                power_law=args.power_law,
            )
        else:
            run = run_fit_multiband if args.band else run_fit
            one = {} if args.band else {"power_law": args.power_law}
            out = run(
                data,
                args.json,
                args.mass,
                lens_light,
                args.source,
                args.solver,
                max_steps=args.max_steps,
                positions=positions,
                positions_sigma=args.positions_sigma,
                mesh=mesh,
                regularization=regularization,
                strength=args.regularization_strength,
                partial=partial,
                **one,
            )
    except (ValueError, OSError, RuntimeError, TypeError) as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"equilens: error: {msg}", file=sys.stderr)
        return 1
    return _exit(out)


def _lens_light(args) -> str | None:
    return None if args.lens_light.lower() == "none" else args.lens_light


def _check_solver(name: str) -> None:
    from .solve import SOLVER_NAMES

    if name.lower() not in SOLVER_NAMES:
        raise ValueError(f"--solver must be one of {', '.join(SOLVER_NAMES)}, got {name!r}")


def _check_numbers(args) -> None:
    """The counts and numbers of `fit`'s and `sample`'s options, before any file is read."""
    if not 1 <= args.supersampling <= MAX_SUPERSAMPLING:
        raise ValueError(
            f"--supersampling must be between 1 and {MAX_SUPERSAMPLING}, got {args.supersampling}"
        )
    if args.max_steps is not None and not 1 <= args.max_steps <= MAX_COUNT:
        raise ValueError(f"--max-steps must be between 1 and {MAX_COUNT}, got {args.max_steps}")
    _check_solver(args.solver)
    if args.positions_sigma is not None:
        if args.positions is None:
            raise ValueError("--positions-sigma needs --positions")
        if not (math.isfinite(args.positions_sigma) and args.positions_sigma > 0):
            raise ValueError(f"--positions-sigma must be > 0 arcsec, got {args.positions_sigma}")
    pixelized = args.source == "pixelized"
    for option, value in (
        ("--mesh", args.mesh),
        ("--regularization", args.regularization),
        ("--regularization-strength", args.regularization_strength),
    ):
        if value is not None and not pixelized:
            raise ValueError(f"{option} is an option of --source pixelized (got {args.source})")
    if args.power_law and not pixelized:
        raise ValueError(f"--power-law is an option of --source pixelized (got {args.source})")
    if args.power_law and args.band:
        raise ValueError("--power-law is an option of one band's pixelized chain, not --band")
    if args.command != "sample":
        return
    for option, value, least, most in (
        ("--chains", args.chains, 1, MAX_COUNT),
        ("--warmup", args.warmup, 0, MAX_COUNT),
        ("--samples", 1 if args.samples is None else args.samples, 1, MAX_COUNT),
        ("--live", args.live, 10, MAX_COUNT),
        ("--networks", args.networks, 1, 64),
        ("--max-tree-depth", 1 if args.max_tree_depth is None else args.max_tree_depth, 1, 20),
        ("--seed", args.seed, 0, 2**32 - 1),
    ):
        if not least <= value <= most:
            raise ValueError(f"{option} must be between {least} and {most}, got {value}")
    if not (math.isfinite(args.prior_width) and args.prior_width > 0):
        raise ValueError(f"--prior-width must be > 0 (errors of the fit), got {args.prior_width}")


def _class_names(node: Any) -> str:
    """`SIE + ExternalShear` for a sum of profiles, the class name for one."""
    from .light import LightSum
    from .mass import MassSum

    parts = node.components if isinstance(node, MassSum | LightSum) else (node,)
    return " + ".join(type(p).__name__ for p in parts)


def _check_model(args, imaging, positions) -> list[str]:
    """The model options of `fit` and `sample` checked on `imaging` (the first band) before
    any fitting: the profile names (the starting model is built), the positions, a
    pixelized source's mesh and regularization. Returns what would be fitted, in words."""
    import equinox as eqx
    import jax
    import numpy as np

    from .solve import as_power_law, start_model

    pixelized = args.source == "pixelized"
    lens_light = _lens_light(args)
    model = start_model(imaging, args.mass, lens_light, "sersic" if pixelized else args.source)
    n_used = int(np.asarray(imaging.mask).sum())
    n_params = sum(
        np.size(leaf) for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    )
    if n_used <= n_params:
        raise ValueError(
            f"the mask leaves {n_used} pixels to fit, not more than the model's {n_params} "
            "parameters (a larger --mask-radius?)"
        )
    lines = [
        f'data: {imaging.shape[0]}x{imaging.shape[1]} pixels of {imaging.pixel_scale:g}" '
        f"({n_used} in the mask), supersampling {imaging.grid.supersampling}",
        "model: "
        + ", ".join(
            f"{field.replace('_', ' ')} {_class_names(getattr(model, field))}"
            for field in ("mass", "lens_light", "source")
            if getattr(model, field) is not None
        ),
        f"solver: {args.solver}",
    ]
    if positions is not None:
        lines.append(f"positions: {len(positions)} images")
    if pixelized:
        power_stage = args.power_law and not args.band and as_power_law(model) is not None
        name = "constant" if args.regularization is None else args.regularization
        mesh = make_mesh(default_mesh(imaging) if args.mesh is None else args.mesh, imaging)
        make_regularization(name, args.regularization_strength)
        lines.append(
            f"pixelized source: {type(mesh).__name__} ({mesh.n_pixels} pixels), {name} "
            "regularization" + ("; then the power-law stage" if power_stage else "")
        )
    return lines


def _exit(out: dict[str, str]) -> int:
    if out["status"] != "successful":
        # the results are written for inspection, but a failed fit is not a success
        what = "the sampling" if "netcdf" in out else "the fit"
        print(f"equilens: {what} did not succeed: {out['status']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
