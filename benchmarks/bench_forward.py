"""Forward-model benchmark: equilens vs lenstronomy on the same machine, in one run.

Model: SIE + external shear lens, Sersic lens light, Sersic source; 100x100 pixels at
0.05", 21x21 pixelated PSF, no supersampling, float64. Times (medians of many calls after
compilation) for the model image and for the value-and-gradient of its chi2 with respect to
all 21 parameters; first-call compile times; lenstronomy's model image on the same arrays.

Run with `nox -s bench` or `python benchmarks/bench_forward.py [--repeats N]`.
"""

import argparse
import os
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

KW_LENS = [
    dict(theta_E=1.2, e1=0.1, e2=-0.05, center_x=0.02, center_y=-0.01),
    dict(gamma1=0.03, gamma2=-0.01, ra_0=0.0, dec_0=0.0),
]
KW_LENS_LIGHT = [
    dict(amp=8.0, R_sersic=0.9, n_sersic=3.5, e1=0.05, e2=0.02, center_x=0.02, center_y=-0.01)
]
KW_SOURCE = [
    dict(amp=20.0, R_sersic=0.15, n_sersic=1.3, e1=0.1, e2=0.1, center_x=0.05, center_y=0.03)
]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def psf_kernel() -> np.ndarray:
    k = np.asarray(el.GaussianPSF(fwhm=0.12, pixel_scale=0.05).kernel())
    pad = (21 - k.shape[0]) // 2
    k = np.pad(k, pad)
    return k / k.sum()


def equilens_setup():
    system = el.LensSystem(
        mass=mass.SIE(**KW_LENS[0]) + mass.ExternalShear(**KW_LENS[1]),
        lens_light=light.Sersic(**KW_LENS_LIGHT[0]),
        source=light.Sersic(**KW_SOURCE[0]),
    )
    grid = el.Grid((100, 100), 0.05)
    psf = el.PixelPSF(psf_kernel())
    conv = psf.fft_operator(grid.shape)
    return system, grid, conv


def bench_equilens(repeats: int) -> dict[str, float]:
    system, grid, conv = equilens_setup()
    out = {}

    # jax.jit over the arrays of the model (the way a fit's inner loop sees it)
    arrays, static_system = eqx.partition((system, conv), eqx.is_array)

    @jax.jit
    def image(arrays):
        system, conv = eqx.combine(arrays, static_system)
        return system.image(grid, conv)

    t0 = time.perf_counter()
    data = image(arrays).block_until_ready()
    out["image_compile"] = time.perf_counter() - t0
    out["image"] = median_time(lambda: image(arrays).block_until_ready(), repeats)

    # chi2 and its gradient with respect to all 21 parameters (shear expansion point fixed)
    noise = jnp.full(grid.shape, 0.05)
    data = data + 0.05 * jax.random.normal(jax.random.key(0), grid.shape)
    free = jax.tree.map(eqx.is_inexact_array, system)
    free = eqx.tree_at(
        lambda s: (s.mass.components[1].ra_0, s.mass.components[1].dec_0), free, (False, False)
    )
    params, static = eqx.partition(system, free)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    assert n_params == 21, n_params

    conv_arrays, conv_static = eqx.partition(conv, eqx.is_array)

    @jax.jit
    def value_and_grad(params, conv_arrays):
        conv = eqx.combine(conv_arrays, conv_static)

        def chi2(p):
            model = eqx.combine(p, static).image(grid, conv)
            return jnp.sum(((model - data) / noise) ** 2)

        return jax.value_and_grad(chi2)(params)

    t0 = time.perf_counter()
    jax.block_until_ready(value_and_grad(params, conv_arrays))
    out["vg_compile"] = time.perf_counter() - t0
    out["vg"] = median_time(
        lambda: jax.block_until_ready(value_and_grad(params, conv_arrays)), repeats
    )

    # The same work inside one compiled loop (as in a fit, where the optimiser's steps run
    # on device): a scan over N slightly different models, so per-call dispatch and
    # thread wake-up are amortised. Every pixel and gradient is consumed (no dead code).
    n_loop = 50

    def perturbed(tree, i):
        # every parameter changes with i, so XLA cannot hoist any of the model out of the loop
        return jax.tree.map(lambda p: p + 1e-12 * i if eqx.is_inexact_array(p) else p, tree)

    @jax.jit
    def image_loop(arrays):
        def body(acc, i):
            system, conv = eqx.combine(arrays, static_system)
            return acc + perturbed(system, i).image(grid, conv).sum(), None

        return jax.lax.scan(body, 0.0, jnp.arange(n_loop, dtype=jnp.float64))[0]

    @jax.jit
    def vg_loop(params, conv_arrays):
        def body(acc, i):
            val, grad = value_and_grad(perturbed(params, i), conv_arrays)
            return acc + val + sum(jnp.sum(g) for g in jax.tree.leaves(grad)), None

        return jax.lax.scan(body, 0.0, jnp.arange(n_loop, dtype=jnp.float64))[0]

    jax.block_until_ready(image_loop(arrays))
    jax.block_until_ready(vg_loop(params, conv_arrays))
    loops = max(5, repeats // 20)
    out["image_loop"] = median_time(lambda: image_loop(arrays).block_until_ready(), loops) / n_loop
    out["vg_loop"] = (
        median_time(lambda: vg_loop(params, conv_arrays).block_until_ready(), loops) / n_loop
    )
    return out


def bench_lenstronomy(repeats: int) -> float | None:
    try:
        from lenstronomy.Data.imaging_data import ImageData
        from lenstronomy.Data.psf import PSF
        from lenstronomy.ImSim.image_model import ImageModel
        from lenstronomy.LensModel.lens_model import LensModel
        from lenstronomy.LightModel.light_model import LightModel
    except ImportError:
        return None
    data = ImageData(
        image_data=np.zeros((100, 100)),
        ra_at_xy_0=-2.475,
        dec_at_xy_0=-2.475,
        transform_pix2angle=np.array([[0.05, 0], [0, 0.05]]),
    )
    psf = PSF(psf_type="PIXEL", kernel_point_source=psf_kernel())
    model = ImageModel(
        data,
        psf,
        lens_model_class=LensModel(["SIE", "SHEAR"]),
        source_model_class=LightModel(["SERSIC_ELLIPSE"]),
        lens_light_model_class=LightModel(["SERSIC_ELLIPSE"]),
        kwargs_numerics={"supersampling_factor": 1, "supersampling_convolution": False},
    )
    img = model.image(KW_LENS, KW_SOURCE, KW_LENS_LIGHT)
    system, grid, conv = equilens_setup()
    ours = np.asarray(system.image(grid, conv))
    diff = float(np.max(np.abs(img - ours)) / np.max(np.abs(img)))
    print(f"  (check: equilens vs lenstronomy model image, max relative difference {diff:.1e})")
    return median_time(lambda: model.image(KW_LENS, KW_SOURCE, KW_LENS_LIGHT), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    print(
        f"forward-model benchmark: 100x100, 21x21 PSF, float64, jax {jax.__version__}, "
        f"{os.cpu_count()} CPU cores, {jax.devices()[0].platform}"
    )
    ours = bench_equilens(args.repeats)
    ref = bench_lenstronomy(args.repeats)
    ms = 1e3
    print(
        f"  equilens model image          {ours['image'] * ms:8.3f} ms   "
        f"(first call incl. compile {ours['image_compile']:.2f} s)"
    )
    print(
        f"  equilens value-and-grad (21)  {ours['vg'] * ms:8.3f} ms   "
        f"(first call incl. compile {ours['vg_compile']:.2f} s)"
    )
    print(f"  equilens model image, inside a compiled loop       {ours['image_loop'] * ms:8.3f} ms")
    print(f"  equilens value-and-grad, inside a compiled loop    {ours['vg_loop'] * ms:8.3f} ms")
    if ref is None:
        print("  lenstronomy not installed: no reference timing")
        return
    print(f"  lenstronomy model image       {ref * ms:8.3f} ms")
    print(f"  ratio lenstronomy / equilens, model image:      {ref / ours['image']:6.2f}x")
    print(f"  ratio lenstronomy / equilens, image in loop:    {ref / ours['image_loop']:6.2f}x")
    print(f"  ratio lenstronomy image / equilens value+grad:  {ref / ours['vg']:6.2f}x")
    print(f"  ratio lenstronomy image / value+grad in loop:   {ref / ours['vg_loop']:6.2f}x")


if __name__ == "__main__":
    main()
