"""Simulate a lens, then fit it back: free parameters, bounds, priors, and errors.

A 100x100 HST-like image of an SIE + shear lens with Sersic lens light and source is
simulated with noise; the fit starts from a generic model, solves the two amplitudes
linearly, fits the 17 other parameters with Levenberg-Marquardt, and prints each parameter
with its 1-sigma error (Laplace approximation) next to the truth. A second fit holds the
lens light fixed and puts a Gaussian prior on the shear. Writes `simulate_and_fit.json` to
$EQUILENS_EXAMPLE_OUT (default: the current folder).

Units: arcsec for angles, electrons/s per pixel for images.
"""

import os

import jax

jax.config.update("jax_enable_x64", True)  # lens models want float64

import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

truth = el.LensSystem(
    mass=mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05) + mass.ExternalShear(gamma1=0.03, gamma2=-0.01),
    lens_light=light.Sersic(amp=8.0, R_sersic=0.9, n_sersic=3.5, e1=0.05),
    source=light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.3, e1=0.1, center_x=0.05),
)
grid = el.Grid((100, 100), pixel_scale=0.05)
psf = el.GaussianPSF(fwhm=0.12, pixel_scale=0.05)
data = el.simulate(
    jax.random.key(42),
    truth,
    grid,
    psf,
    exposure_time=2000.0,
    sky_level=1.0,
    mask=grid.circular_mask(2.5),
)

# A generic start: round profiles at the centre, no shear; amplitudes are solved linearly.
start = el.LensSystem(
    mass=mass.SIE(theta_E=1.0) + mass.ExternalShear(0.0, 0.0),
    lens_light=light.Sersic(amp=1.0, R_sersic=0.5, n_sersic=4.0),
    source=light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0),
)
objective = el.Objective(el.GaussianLikelihood(data))  # linear=True: amplitudes solved
result = el.fit(objective, start, "lbfgs", max_steps=1000)
print(result.table())

# Compare with the truth, parameter by parameter.
param = el.objective.Parametrisation.build(truth)
truth_values = dict(
    zip(param.paths(truth), np.concatenate([np.ravel(v) for v in param.values(truth)]), strict=True)
)
for name, value, error in zip(result.names, result.values, result.errors, strict=True):
    pull = (float(value) - truth_values[name]) / float(error)
    print(
        f"{name:32s} fit {float(value):9.5f} +- {float(error):.5f}   "
        f"truth {truth_values[name]:9.5f}   ({pull:+.1f} sigma)"
    )

# Polish with Levenberg-Marquardt from there, with the lens light held fixed and a Gaussian
# prior on the shear components: free parameters are chosen with a filter over the model.
prior = [
    el.GaussianPrior(lambda s: s.mass.components[1].gamma1, 0.0, 0.05),
    el.GaussianPrior(lambda s: s.mass.components[1].gamma2, 0.0, 0.05),
]
objective2 = el.Objective([el.GaussianLikelihood(data), *prior])
free = el.select(result.model, lambda s: (s.mass, s.source))
polished = el.fit(objective2, result.model, "lm", free=free)
print(
    f"\nwith the lens light fixed and shear priors: theta_E = "
    f"{float(polished.model.mass.components[0].theta_E):.4f} +- {float(polished.errors[0]):.4f}"
)

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
el.solve.write_json(os.path.join(out, "simulate_and_fit.json"), polished)
assert abs(float(polished.model.mass.components[0].theta_E) - 1.2) < 0.01
