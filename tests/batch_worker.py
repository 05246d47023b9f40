"""The several-elements-per-device batch check (tests/test_sharding.py), in its own process
so that a deadlock fails the test on a timeout instead of hanging the suite: run as
`python batch_worker.py`. Fits 8 starts with Levenberg-Marquardt (a batched QR per step)
over 4 CPU devices (2 per device) and on one device; prints, as JSON, both batches'
values, steps and fitted Einstein radii, whether jaxlib's batched LAPACK kernels can
deadlock on the mesh, and the warnings `shard(batch=True)` gave for 2 elements per
device."""

import json
import os
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)


def main() -> None:
    import equilens as el
    from equilens import light, mass
    from equilens._sharding import lapack_batches_deadlock

    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, -0.01),
        lens_light=light.Sersic(amp=4.0, R_sersic=0.8, n_sersic=3.5),
        source=light.Sersic(amp=12.0, R_sersic=0.15, n_sersic=1.3, center_x=0.05),
    )
    grid = el.Grid((30, 30), 0.1)
    data = el.simulate(
        jax.random.key(0),
        truth,
        grid,
        el.GaussianPSF(0.15, 0.1),
        exposure_time=1000.0,
        sky_level=1.0,
        mask=grid.circular_mask(1.45),
    )
    objective = el.Objective(el.GaussianLikelihood(data))
    scale = 1 + 0.005 * jnp.arange(-4.0, 4.0)
    starts = jax.tree.map(lambda x: x * scale.reshape(8, *([1] * jnp.ndim(x))), truth)
    mesh = el.device_mesh(4)
    whole = el.fit_batch(objective, starts, "lm", max_steps=40)
    split = el.fit_batch(objective, starts, "lm", max_steps=40, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        el.shard(starts, mesh, batch=True)
    out = {
        "affected": lapack_batches_deadlock(mesh),
        "warnings": [str(w.message) for w in caught],
        "value": [float(v) for v in split.value],
        "value_single": [float(v) for v in whole.value],
        "steps": [int(s) for s in split.num_steps],
        "steps_single": [int(s) for s in whole.num_steps],
        "theta_E": [float(t) for t in split.model.mass.components[0].theta_E],
        "theta_E_single": [float(t) for t in whole.model.mass.components[0].theta_E],
        "success": bool(split.success and whole.success),
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
