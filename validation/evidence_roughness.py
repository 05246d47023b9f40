"""How rough is a pixelized source's log-evidence around a fitted smooth model?

Evaluates the scan's objective (`LogEvidence`, the source's hyperparameters held as
`subhalo_scan` holds them) along a line through the smooth model for each free parameter,
`--points` values over +-`--width` times a step per parameter (0.01 in its units: arcsec
for the Einstein radius and centres, dimensionless for ellipticities, shears and the
slope), and reports, per parameter, the mean drop at the line's two ends ("ends") and
what a smooth function would not have: the RMS and largest residual about a quartic fitted
to the line, and the number of local maxima along it ("rise": the line's highest value
above the model's). A function smooth on the line's scale has residuals near round-off and one
maximum; kinks (traced pixels crossing the mesh's cells, the quantile nodes' order
changing) show as residuals of order the evidence's local maxima spread.

    python validation/evidence_roughness.py OUT_smooth.pkl IMAGE NOISE PSF
        --pixel-scale 0.05 --mask-radius R [--points 201] [--width 1.0]

`OUT_smooth.pkl` is `equilens subhalo`'s kept smooth model (a run of the same data and
settings: the fingerprint is not checked here). Float64.
"""

import argparse
import pickle
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

from equilens.cli._data import _load  # noqa: E402
from equilens.objective import Objective  # noqa: E402
from equilens.solve._parametrise import parametrisation  # noqa: E402
from equilens.subhalo._scan import scan_free  # noqa: E402
from equilens.subhalo._smooth import _as_sum  # noqa: E402
from equilens.terms import LogEvidence  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("smooth")
    p.add_argument("image")
    p.add_argument("noise")
    p.add_argument("psf")
    p.add_argument("--pixel-scale", type=float, required=True)
    p.add_argument("--mask-radius", type=float, required=True)
    p.add_argument("--points", type=int, default=201)
    p.add_argument("--width", type=float, default=1.0, help="half-width in 0.01 steps")
    a = p.parse_args()
    with open(a.smooth, "rb") as f:
        kept = pickle.load(f)
    imaging = _load(a.image, a.noise, a.psf, a.pixel_scale, None, a.mask_radius, 1)
    objective = Objective(LogEvidence(imaging, adapt_image=kept["adapt_image"]))
    model = _as_sum(kept["smooth"].model)
    free, held = scan_free(objective, model, None, None)
    param = parametrisation(objective, model, free, None)
    x0, unravel = ravel_pytree(param.values(model))
    names = [path.lstrip(".") for path, f in zip(param.leaf_paths, param.free, strict=True) if f]
    if len(names) != x0.shape[0]:  # (a free leaf that is not a scalar)
        names = [f"p{i}" for i in range(x0.shape[0])]

    @eqx.filter_jit
    def log_e(x):
        return -objective(param.with_values(unravel(x), model))

    t = np.linspace(-1.0, 1.0, a.points)
    base = float(log_e(x0))
    print(f"smooth model: log E {base:.3f}; held {held}; {x0.shape[0]} free parameters")
    print(
        f"{'parameter':>40} {'value':>10} {'ends':>9} {'rms':>8} {'max':>8} {'maxima':>6} "
        f"{'rise':>8}"
    )
    t0 = time.perf_counter()
    for k in range(x0.shape[0]):
        step = 0.01 * a.width
        xs = [x0.at[k].add(step * s) for s in t]
        v = np.asarray([float(log_e(x)) for x in xs]) - base
        ok = np.isfinite(v)
        coef = np.polyfit(t[ok], v[ok], 4)
        r = v[ok] - np.polyval(coef, t[ok])
        inner = v[1:-1]
        maxima = int(np.sum((inner > v[:-2]) & (inner > v[2:])))
        print(
            f"{names[k]:>40} {float(x0[k]):>10.4f} {(v[0] + v[-1]) / 2:>9.2f} "
            f"{np.sqrt(np.mean(r**2)):>8.3f} "
            f"{np.max(np.abs(r)):>8.3f} {maxima:>6d} {np.nanmax(v):>8.3f}"
        )
    print(f"{a.points} points a parameter, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
