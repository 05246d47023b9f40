"""Model comparison by the Bayesian evidence: SIE against a power law (EPL).

A lens whose mass is steeper than isothermal (EPL with density slope gamma = 2.2) is
simulated (40x40 pixels of 0.1", Gaussian PSF, Sersic source). Both models are sampled
with nested sampling (`equilens.nested_sample`: nautilus on the Numba likelihood, `pip
install equilens[sampling]`) under the same priors for the shared parameters, uniform
on fixed boxes (not on boxes from a fit, so the evidences are comparable); the EPL adds a
uniform prior on gamma in (1.5, 2.8). The log Bayes factor ln(Z_EPL / Z_SIE) is printed
with its error: on this lens it strongly favours the EPL, and the EPL's gamma posterior
holds the truth. Writes `model_comparison.json` to $EQUILENS_EXAMPLE_OUT (default: the
current folder).

Units: arcsec for angles, electrons/s per pixel for images; evidences are natural logs.
"""

import json
import math
import os
import time

import jax

jax.config.update("jax_enable_x64", True)


import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

source = light.Sersic(amp=15.0, R_sersic=0.2, n_sersic=1.2, e1=0.1, e2=0.05, center_x=0.08)
truth = el.LensSystem(
    mass=mass.EPL(theta_E=1.1, gamma=2.2, e1=0.08, e2=-0.05, center_x=0.02, center_y=-0.01),
    source=source,
)
grid = el.Grid((40, 40), 0.1)
psf = el.GaussianPSF(fwhm=0.15, pixel_scale=0.1)
data = el.simulate(jax.random.key(5), truth, grid, psf, exposure_time=500.0, sky_level=0.5)
objective = el.Objective(el.GaussianLikelihood(data))  # the source amplitude is solved


def priors(lens):
    """The same boxes for both models' shared parameters (the class bounds for
    ellipticities: (-0.6, 0.6))."""
    return {
        lambda m: m.mass.theta_E: (0.8, 1.5),
        lambda m: (m.mass.center_x, m.mass.center_y): (-0.2, 0.2),
        lambda m: m.source.R_sersic: (0.05, 0.6),
        lambda m: m.source.n_sersic: (0.5, 4.0),
        lambda m: (m.source.center_x, m.source.center_y): (-0.4, 0.4),
        **({lambda m: m.mass.gamma: (1.5, 2.8)} if isinstance(lens, mass.EPL) else {}),
    }


results = {}
for name, lens in (
    ("SIE", mass.SIE(theta_E=1.0)),
    ("EPL", mass.EPL(theta_E=1.0, gamma=2.0)),
):
    model = el.LensSystem(mass=lens, source=light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0))
    t0 = time.perf_counter()
    post = el.nested_sample(
        objective, model, bounds=priors(lens), n_live=500, n_eff=2000, n_networks=1, seed=1
    )
    wall = time.perf_counter() - t0
    print(f"--- {name}: {wall:.0f} s, {post.n_likelihood} likelihood calls ({post.backend})")
    print(post.summary())
    results[name] = post

z_sie, z_epl = results["SIE"], results["EPL"]
log_b = z_epl.log_evidence - z_sie.log_evidence
err = math.hypot(z_epl.log_evidence_error, z_sie.log_evidence_error)
print(f"ln(Z_EPL / Z_SIE) = {log_b:.2f} +- {err:.2f}")
k = z_epl.names.index("mass.gamma")
gamma, gamma_sd = z_epl.mean()[k], z_epl.std()[k]
print(f"EPL gamma = {gamma:.3f} +- {gamma_sd:.3f} (truth 2.2)")
assert log_b > 5 + 3 * err, "the evidence should strongly favour the EPL on this lens"
assert abs(gamma - 2.2) < 4 * gamma_sd

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
with open(os.path.join(out, "model_comparison.json"), "w") as f:
    json.dump(
        {name: post.to_dict() for name, post in results.items()}
        | {"log_bayes_factor_epl_sie": float(log_b), "error": float(err)},
        f,
        indent=2,
    )
print(f"gamma posterior std / box width: {gamma_sd / 1.3:.3f}; results in {out}")
