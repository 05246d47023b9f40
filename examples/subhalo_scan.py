"""Scan a lens for a dark subhalo: simulate a lens with a 1e10 Msun pseudo-Jaffe subhalo on
its arc, fit the smooth model, then scan a 3x3 grid of cells, each the smooth model plus a
subhalo confined to it (the macro model refitted), ranked by the Bayesian evidence against
the smooth model (`equilens.subhalo_scan`).

Prints the Delta log-evidence of every cell and the best subhalo next to the truth, and
writes the map (`subhalo_scan.png`) and the JSON summary (`subhalo_scan.json`) to
$EQUILENS_EXAMPLE_OUT (default: the current folder). About a minute on 2 CPU cores.

Units: arcsec for positions (x along the image's columns, y along its rows), Msun for
masses; redshifts those of SDSS J0946+1006 (0.222, 0.609).
"""

import json
import os

import jax

jax.config.update("jax_enable_x64", True)  # lens models want float64

import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402
from equilens.subhalo import Subhalo, plot_subhalo_scan  # noqa: E402

cosmology = el.LensCosmology(0.222, 0.609)
macro = mass.SIE(theta_E=1.2, e1=0.05, e2=-0.03) + mass.ExternalShear(gamma1=0.02, gamma2=0.01)
source = light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.0, center_x=0.05, e1=0.1)
# the truth's subhalo: 1e10 Msun in total, on the upper arc at (0.05, 1.15)
subhalo = Subhalo(
    log10_mass=10.0,
    cell_x=0.05,
    cell_y=1.15,
    half=0.1,
    host_theta_E=1.2,
    cosmology=cosmology,
    kind="pseudo_jaffe",
)
truth = el.LensSystem(mass=macro + subhalo.profile(), source=source)
grid = el.Grid((80, 80), pixel_scale=0.05)
psf = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05)
r = np.hypot(np.asarray(grid.x), np.asarray(grid.y))
data = el.simulate(
    jax.random.key(1),
    truth,
    grid,
    psf,
    exposure_time=2000.0,
    sky_level=1.0,
    mask=(r > 0.5) & (r < 1.9),
)

# the smooth model: no subhalo (a parametric source: the amplitudes solved linearly)
objective = el.Objective(el.GaussianLikelihood(data))
smooth = el.fit(objective, el.LensSystem(mass=macro, source=source))
print(f"smooth fit: {smooth.message()}, reduced chi2 {float(smooth.reduced_chi2):.3f}")

scan = el.subhalo_scan(objective, smooth, cosmology, grid=3, kind="pseudo_jaffe")
for (x, y), d in zip(scan.centres, scan.delta_log_evidence, strict=True):
    print(f'  cell at ({x:+.2f}, {y:+.2f})": Delta log E {d:9.1f}')
best = scan.best
n = round(len(scan.refinement.centres) ** 0.5) if scan.refinement is not None else 0
print(
    f"best cell refined by {n} x {n} sub-cells: Delta log E {best['cell_delta_log_evidence']:.1f} "
    f"(coarse {scan.delta_log_evidence[scan.best_index]:.1f}); best sub-cell {best['sub_cell']}"
)
print(
    f"best subhalo at ({best['center_x']:+.3f} +- {best['center_x_error']:.3f}, "
    f'{best["center_y"]:+.3f} +- {best["center_y_error"]:.3f})" (truth (+0.050, +1.150)), '
    f"log10 mass {best['log10_mass']:.3f} +- {best['log10_mass_error']:.3f} (truth 10), "
    f"{best['mass_within_1kpc']:.3g} Msun within 1 kpc, "
    f"Delta log E {best['delta_log_evidence']:.1f}"
)

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
plot_subhalo_scan(scan, objective, os.path.join(out, "subhalo_scan.png"), title="subhalo scan")
with open(os.path.join(out, "subhalo_scan.json"), "w") as f:
    json.dump(scan.to_dict(), f, indent=2)
