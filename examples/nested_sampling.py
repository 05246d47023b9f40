"""Nested sampling of a lens posterior on the Numba backend, with nautilus.

A lens simulated with equilens (SIE + external shear, Sersic source; 60x60 pixels of
0.08", Gaussian PSF) is sampled with the nautilus nested sampler (`pip install
equilens[sampling]`), its likelihood evaluated by `equilens.numba.log_density`: a plain
function of a NumPy vector, on every core through Numba's threads, with no JAX tracing
per call. Prints the log-evidence with its error and the posterior of each parameter
against the truth; writes a corner plot (`corner`) to $EQUILENS_EXAMPLE_OUT (default the
working directory).

The prior is uniform on a box (nautilus samples the unit cube): the class bounds of
equilens (ellipticities in (-0.6, 0.6), shear in (-0.5, 0.5), ...) narrowed for the
parameters whose class bound is infinite (Einstein radius, centres, source size).
"""

import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import corner  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from nautilus import Sampler  # noqa: E402

import equilens as el  # noqa: E402
import equilens.numba as enb  # noqa: E402
from equilens import light, mass  # noqa: E402

truth = el.LensSystem(
    mass=mass.SIE(theta_E=1.1, e1=0.08, e2=-0.05, center_x=0.02, center_y=-0.01)
    + mass.ExternalShear(gamma1=0.03, gamma2=0.01),
    source=light.Sersic(
        amp=12.0, R_sersic=0.2, n_sersic=1.2, e1=0.1, e2=0.05, center_x=0.08, center_y=0.04
    ),
)
grid = el.Grid((60, 60), 0.08)
psf = el.GaussianPSF(fwhm=0.12, pixel_scale=0.08)
data = el.simulate(jax.random.key(3), truth, grid, psf, exposure_time=1500.0, sky_level=0.5)
objective = el.Objective(el.GaussianLikelihood(data))  # the source amplitude is solved

# the prior box: finite for every free parameter
s, src = (lambda m: m.mass.components[0]), (lambda m: m.source)
bounds = {
    lambda m: s(m).theta_E: (0.5, 2.0),
    lambda m: (s(m).center_x, s(m).center_y): (-0.3, 0.3),
    lambda m: src(m).R_sersic: (0.02, 1.0),
    lambda m: src(m).n_sersic: (0.5, 4.0),
    lambda m: (src(m).center_x, src(m).center_y): (-0.5, 0.5),
}
dens = enb.log_density(objective, truth, bounds=bounds)
lo, hi = dens.bounds[:, 0], dens.bounds[:, 1]
print(f"{len(dens.names)} parameters: {', '.join(dens.names)}")

t0 = time.perf_counter()
dens.f(dens.x0)  # compiles the Numba kernels (or loads them from the disk cache)
calls = 200
for _ in range(calls):
    dens.f(dens.x0)
per_call = (time.perf_counter() - t0) / (calls + 1)
print(f"likelihood: {per_call * 1e3:.2f} ms per call (first call included)")

sampler = Sampler(
    lambda u: lo + (hi - lo) * u,  # the unit cube onto the uniform prior box
    dens.f,
    n_dim=len(dens.names),
    n_live=300,
    n_networks=1,
    seed=1,
)
t0 = time.perf_counter()
sampler.run(n_eff=1000, verbose=False)
wall = time.perf_counter() - t0
# equal-weight posterior samples (the exploration's points of negligible weight dropped)
samples, _, _ = sampler.posterior(equal_weight=True)
print(
    f"nautilus: {sampler.n_like} likelihood calls in {wall:.1f} s, {len(samples)} posterior "
    f"samples; log Z = {sampler.log_z:.2f} (uniform prior on the box)"
)

mean, std = samples.mean(axis=0), samples.std(axis=0)
true = dens.x0  # dens.x0 is the model it was built from: here the truth
print(f"{'parameter':<28} {'truth':>9} {'mean':>9} {'std':>8} {'(mean-truth)/std':>17}")
for name, t, m, sd in zip(dens.names, true, mean, std, strict=True):
    print(f"{name:<28} {t:9.4f} {m:9.4f} {sd:8.4f} {(m - t) / sd:17.2f}")
pulls = np.abs(mean - true) / std
assert np.all(pulls < 5), "the posterior misses the truth"

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
figure = corner.corner(
    samples, labels=[n.split(".")[-1] for n in dens.names], truths=true, show_titles=True
)
path = os.path.join(out, "nested_sampling_corner.png")
figure.savefig(path, dpi=60)
print(f"corner plot: {path}")
