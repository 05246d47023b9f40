"""The joint likelihood of several bands against its bands taken one by one, in one run.

Data: examples/multiband_simulated.py's four bands of one lens (a 100x100 band at 0.05"
and three 50x50 bands at 0.1", Gaussian PSFs of 0.10-0.30"; 2.4" mask), float64; the
model a `MultiBandLensSystem` (SIE + shear, Sersic lens light and source shared in shape,
amplitudes solved linearly in every band).

- JAX: value and gradient of the joint `MultiBandTerm` (one jitted call) against the sum
  of the four single-band `GaussianLikelihood`s' value-and-gradient calls (four jitted
  calls): what the joint term costs beyond its bands.
- Numba: `equilens.numba.value` of the joint term against JAX's jitted value, on 1 and 2
  Numba threads (the calls alternating).

Medians of many calls, with the load average. Run with `nox -s bench` or
`python benchmarks/bench_multiband.py [--repeats N]`.
"""

import argparse
import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
from bench_forward import median_time  # noqa: E402
from bench_numba import alternate  # noqa: E402

import equilens as el  # noqa: E402
import equilens.numba as enb  # noqa: E402
from equilens import light, mass  # noqa: E402

# name, pixel scale (arcsec), PSF FWHM (arcsec), grid side, lens and source amplitudes
BANDS = [
    ("VIS", 0.05, 0.10, 100, 4.0, 12.0),
    ("Y", 0.10, 0.20, 50, 14.0, 14.0),
    ("J", 0.10, 0.25, 50, 20.0, 12.0),
    ("H", 0.10, 0.30, 50, 26.0, 10.0),
]


def setup():
    lens_mass = mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, -0.01)
    bands = []
    for k, (_, scale, fwhm, side, lens_amp, source_amp) in enumerate(BANDS):
        truth = el.LensSystem(
            mass=lens_mass,
            lens_light=light.Sersic(amp=lens_amp, R_sersic=0.8, n_sersic=3.5, e1=0.05),
            source=light.Sersic(amp=source_amp, R_sersic=0.15, n_sersic=1.3, center_x=0.05),
        )
        grid = el.Grid((side, side), pixel_scale=scale)
        psf = el.GaussianPSF(fwhm=fwhm, pixel_scale=scale)
        bands.append(
            el.simulate(
                jax.random.key(k), truth, grid, psf, exposure_time=1000.0, sky_level=1.0,
                mask=grid.circular_mask(2.4),
            )
        )  # fmt: skip
    data = el.MultiBandImaging(bands, names=[b[0] for b in BANDS])
    model = el.MultiBandLensSystem(
        lens_mass,
        source=light.Sersic(amp=1.0, R_sersic=0.16, n_sersic=1.2, center_x=0.04),
        lens_light=light.Sersic(amp=1.0, R_sersic=0.75, n_sersic=3.3, e1=0.04),
        bands=len(bands),
    )
    return data, model


def main(repeats: int) -> None:
    data, model = setup()
    joint = el.MultiBandTerm.build(data, el.GaussianLikelihood)
    singles = joint.terms
    systems = model.bands()
    grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t: t(m)))

    def joint_call():
        jax.block_until_ready(grad(model, joint))

    def singles_call():
        jax.block_until_ready([grad(s, t) for s, t in zip(systems, singles, strict=True)])

    t0 = time.perf_counter()
    joint_call()
    compile_joint = time.perf_counter() - t0
    t0 = time.perf_counter()
    singles_call()
    compile_singles = time.perf_counter() - t0
    t_joint = median_time(joint_call, repeats)
    t_singles = median_time(singles_call, repeats)
    print(f"bench_multiband: 4 bands, {joint.n_data} mask pixels; load average "
          f"{os.getloadavg()[0]:.2f}; {repeats} calls each")  # fmt: skip
    print(f"  JAX value+gradient, joint term     {1e3 * t_joint:8.2f} ms "
          f"(compile {compile_joint:.1f} s)")  # fmt: skip
    print(f"  JAX value+gradient, 4 single bands {1e3 * t_singles:8.2f} ms "
          f"(compile {compile_singles:.1f} s)")  # fmt: skip
    print(f"  ratio singles/joint {t_singles / t_joint:.2f}")

    value = eqx.filter_jit(lambda m, t: t(m))
    jax.block_until_ready(value(model, joint))
    enb.value(joint, model)  # compiles (or loads) the kernels
    times = alternate(
        lambda: jax.block_until_ready(value(model, joint)),
        lambda: enb.value(joint, model),
        repeats,
    )
    print(f"  joint value: JAX {1e3 * times['jax']:.2f} ms, Numba 1 thread "
          f"{1e3 * times['numba_1']:.2f} ms, 2 threads {1e3 * times['numba_2']:.2f} ms "
          f"(JAX/Numba-2 {times['jax'] / times['numba_2']:.2f})")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    main(parser.parse_args().repeats)
