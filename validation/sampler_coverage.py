"""Coverage of nested sampling's posterior intervals on simulated lenses.

Twenty noise realisations of one lens (an SIE with theta_E 1", and a Sersic source: 32x32
pixels of 0.1", a Gaussian PSF of FWHM 0.15", 500 s exposures with sky 0.5 e-/s), each
fitted from the truth and then sampled by `equilens.nested_sample` (SIE theta_E, e1, e2 and
the source's radius, index and centre free, its amplitude solved linearly; the prior the
fit +- 10 Laplace errors). A calibrated posterior puts the true theta_E inside its 16-84%
interval in 68% of the realisations (binomial sd 10% for 20). Prints one line per
realisation and the count; `--json` writes them.

    python validation/sampler_coverage.py [--n 20] [--json coverage.json]

Needs `equilens[sampling]`. About 5 minutes on 2 cores (tests/test_nested.py runs it).
"""

import argparse
import json
import time

import jax

jax.config.update("jax_enable_x64", True)

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

THETA_E = 1.0


def lens():
    """The true lens, the free parameters, the grid and the PSF."""
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=THETA_E, e1=0.06, e2=-0.03),
        source=light.Sersic(amp=8.0, R_sersic=0.15, n_sersic=1.2, center_x=0.06, center_y=0.02),
    )
    free = el.select(
        truth,
        lambda s: (
            s.mass.theta_E, s.mass.e1, s.mass.e2, s.source.R_sersic, s.source.n_sersic,
            s.source.center_x, s.source.center_y,
        ),
    )  # fmt: skip
    grid = el.Grid((32, 32), 0.1)
    return truth, free, grid, el.GaussianPSF(0.15, 0.1)


def realisation(seed: int):
    """Noise realisation `seed`: its objective, the fit from the truth, the free
    parameters."""
    truth, free, grid, psf = lens()
    data = el.simulate(
        jax.random.key(100 + seed), truth, grid, psf, exposure_time=500.0, sky_level=0.5,
        mask=grid.circular_mask(1.6),
    )  # fmt: skip
    objective = el.Objective(el.GaussianLikelihood(data))
    return objective, el.fit(objective, truth, free=free), free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20, help="noise realisations (seeds 0..n-1)")
    parser.add_argument("--json", help="write the per-realisation intervals here")
    args = parser.parse_args()
    rows = []
    for seed in range(args.n):
        t0 = time.perf_counter()
        objective, fit, free = realisation(seed)
        post = el.nested_sample(
            objective, fit, free=free, box_width=10.0, n_live=300, n_eff=1000, n_networks=1,
            seed=seed,
        )  # fmt: skip
        k = post.names.index("mass.theta_E")
        lo, hi = (float(x) for x in post.quantiles()[[0, 2], k])
        inside = lo <= THETA_E <= hi
        rows.append({"seed": seed, "p16": lo, "p84": hi, "inside": inside})
        print(
            f"seed {seed:2d}: theta_E 16-84% [{lo:.4f}, {hi:.4f}] "
            f"{'contains' if inside else 'misses  '} {THETA_E} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    hits = sum(r["inside"] for r in rows)
    print(f"the true theta_E inside the 16-84% interval in {hits} of {args.n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hits": hits, "n": args.n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
