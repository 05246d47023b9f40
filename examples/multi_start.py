"""Multi-start fitting and a hyperparameter survey, each one vmapped batch.

Starting Einstein radii are drawn from a uniform prior (which also bounds the fit), all
starts are fitted at once with `vmap`, and the best is kept; every start's result is
returned. Then the same batched machinery runs a survey over the weight of a Gaussian prior
on theta_E, showing how a strong prior pulls the fit. Writes nothing; prints the results.
"""

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

truth = el.LensSystem(
    mass=mass.SIE(theta_E=1.0, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01),
    source=light.Sersic(amp=15.0, R_sersic=0.15, n_sersic=1.2, center_x=0.05, e2=0.1),
)
grid = el.Grid((48, 48), 0.06)
data = el.simulate(
    jax.random.key(0),
    truth,
    grid,
    el.GaussianPSF(0.12, 0.06),
    exposure_time=1500.0,
    sky_level=0.5,
    mask=grid.circular_mask(1.4),
)
start = el.LensSystem(
    mass=mass.SIE(theta_E=0.9) + mass.ExternalShear(0.0, 0.0),
    source=light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0),
)
prior = el.UniformPrior(lambda s: s.mass.components[0].theta_E, 0.5, 1.8)
objective = el.Objective([el.GaussianLikelihood(data), prior])
ms = el.solve.multi_start(jax.random.key(1), objective, start, "lm", n_starts=4)
print("starts: theta_E", np.round(np.asarray(ms.starts.model.mass.components[0].theta_E), 4))
print("        objective", np.round(np.asarray(ms.starts.value), 2))
print(f"best start {ms.best_index}:\n{ms.best.table()}")

# Survey: the weight of a Gaussian prior theta_E ~ N(1.1, 0.01^2), from negligible to strong.
survey_obj = el.Objective(
    [
        el.GaussianLikelihood(data),
        el.GaussianPrior(lambda s: s.mass.components[0].theta_E, 1.1, 0.01),
    ]
)
weights = jnp.array([[1.0, w] for w in (1e-2, 1.0, 1e2, 1e4)])
batched = eqx.tree_at(lambda o: o.weights, survey_obj, weights)
starts = jax.tree.map(lambda x: jnp.stack([x] * 4), ms.best.model)
survey = el.fit_batch(batched, starts, "lm", objective_batched=lambda o: o.weights)
for w, te in zip(weights[:, 1], survey.model.mass.components[0].theta_E, strict=True):
    print(f"prior weight {float(w):8.4f}: theta_E = {float(te):.4f}")
