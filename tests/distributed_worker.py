"""One process of the two-process `jax.distributed` check (tests/test_sharding.py): run as
`python distributed_worker.py PROCESS_ID PORT`; each process has 2 CPU devices, the global
mesh all 4. Prints, as JSON, the objective's value and gradient sharded over the global
mesh and on this process's first device alone."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import equinox as eqx
import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)
# (CPU devices of several processes talk through gloo)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int) -> None:
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    import equilens as el
    from equilens import light, mass

    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.0, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01),
        source=light.Sersic(amp=15.0, R_sersic=0.15, n_sersic=1.2, center_x=0.05, e2=0.1),
    )
    grid = el.Grid((37, 41), 0.08, supersampling=2)
    data = el.simulate(
        jax.random.key(0),
        truth,
        grid,
        el.GaussianPSF(0.1, 0.08),
        exposure_time=1500.0,
        sky_level=0.5,
        mask=grid.circular_mask(1.4),
    )
    objective = el.Objective(el.GaussianLikelihood(data))
    model = eqx.tree_at(lambda s: s.mass.components[0].theta_E, truth, jnp.asarray(1.02))
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, o: o(m)))
    mesh = el.device_mesh()
    v, g = value_and_grad(model, el.shard(objective, mesh))
    v1, g1 = value_and_grad(model, objective)
    out = {
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "mesh_devices": int(mesh.size),
        "value": float(v),
        "value_single": float(v1),
        "grad": [float(x) for x in jax.tree.leaves(g)],
        "grad_single": [float(x) for x in jax.tree.leaves(g1)],
    }
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
