"""Nested sampling of the real HST lens SDSS J0946+1006 (shipped with equilens) on the
Numba backend, with nautilus.

The dataset is `fit_hst_lens.py`'s (FITS image, noise map, PSF, nearby galaxies masked, a
3" circular mask, cropped), without supersampling (one ray per pixel: what keeps
~10^5 likelihood calls to a couple of minutes on 2 cores). The staged fit
(`equilens.solve.fit_lens`: SIE + shear, Sersic lens light, Sersic source) gives the start;
the lens light is then held at its fit (`FixedLight`: the posterior is conditional on it,
as in PyAutoLens's chained pipelines), and the 13 parameters of the mass (SIE + shear)
and the source (Sersic shape; its amplitude solved linearly in every call) are sampled
with nautilus (`pip install equilens[sampling]`) on `equilens.numba.log_density`, whose
`f` runs the Numba kernels on every core (`backend="numba"`: at this image size the
default "auto" would take JAX, 15% faster per call on 2 cores). Prints the log-evidence,
the posterior of each parameter and the Einstein radius against the published 1.38"
(Bolton et al. 2008); writes a corner plot to $EQUILENS_EXAMPLE_OUT (default the working
directory).

The prior is uniform on a box around the fit, wide against the posterior (several tens of
its widths); nautilus samples the unit cube mapped onto it.
"""

import math
import os
import time
from importlib.resources import files

import jax

jax.config.update("jax_enable_x64", True)

import corner  # noqa: E402
import equinox as eqx  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from nautilus import Sampler  # noqa: E402

import equilens as el  # noqa: E402
import equilens.numba as enb  # noqa: E402
from equilens import light  # noqa: E402

folder = files("equilens") / "_data" / "SDSSJ0946+1006"
full = el.Imaging.from_fits(
    str(folder / "image.fits"),
    str(folder / "noise_map.fits"),
    str(folder / "psf.fits"),
    pixel_scale=0.05,
    exclude_mask=str(folder / "mask_extra_galaxies.fits"),
)
mask = np.asarray(full.mask) & full.grid.circular_mask(3.0)
imaging = el.Imaging(
    np.asarray(full.data), np.asarray(full.noise_map), full.psf, 0.05, mask=mask
).cropped()
print(f"{imaging.shape} pixels after cropping, {int(imaging.mask.sum())} in the mask")

t0 = time.perf_counter()
fit = el.solve.fit_lens(imaging, mass="sie+shear", lens_light="sersic", source="sersic")
print(f"staged fit: {time.perf_counter() - t0:.0f} s, reduced chi2 {fit.reduced_chi2:.3f}")

# the lens light held at its fit; the source amplitude solved linearly in every call
start = eqx.tree_at(lambda m: m.lens_light, fit.model, light.FixedLight(fit.model.lens_light))
objective = el.Objective(el.GaussianLikelihood(imaging))

sie, shear, src = (
    (lambda m: m.mass.components[0]),
    (lambda m: m.mass.components[1]),
    (lambda m: m.source),
)
widths = {
    lambda m: sie(m).theta_E: 0.15,
    lambda m: sie(m).e1: 0.15,
    lambda m: sie(m).e2: 0.15,
    lambda m: sie(m).center_x: 0.1,
    lambda m: sie(m).center_y: 0.1,
    lambda m: shear(m).gamma1: 0.1,
    lambda m: shear(m).gamma2: 0.1,
    lambda m: src(m).R_sersic: 0.3,
    lambda m: src(m).n_sersic: 2.0,
    lambda m: src(m).e1: 0.3,
    lambda m: src(m).e2: 0.3,
    lambda m: src(m).center_x: 0.3,
    lambda m: src(m).center_y: 0.3,
}
# each parameter's box: the fit +- its width, inside the class's own bounds
classes = enb.log_density(objective, start)
own = dict(zip(classes.names, classes.bounds, strict=True))
bounds = {s: (float(s(start)) - w, float(s(start)) + w) for s, w in widths.items()}
dens = enb.log_density(objective, start, bounds=bounds, backend="numba")
box = dens.bounds.copy()
for k, name in enumerate(dens.names):
    lo_own, hi_own = own[name]
    box[k] = (max(box[k, 0], lo_own), min(box[k, 1], hi_own))
    if not box[k, 0] < dens.x0[k] < box[k, 1]:
        raise RuntimeError(f"the fit's {name} = {dens.x0[k]} is outside its box {box[k]}")
lo, hi = box[:, 0], box[:, 1]
print(f"{len(dens.names)} parameters on the {dens.backend} backend: {', '.join(dens.names)}")

t0 = time.perf_counter()
calls = 100
for _ in range(calls):
    dens.f(dens.x0)
print(f"likelihood: {(time.perf_counter() - t0) / calls * 1e3:.2f} ms per call")

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
samples, _, _ = sampler.posterior(equal_weight=True)
print(
    f"nautilus: {sampler.n_like} likelihood calls in {wall:.1f} s, {len(samples)} posterior "
    f"samples; log Z = {sampler.log_z:.2f} +- {1 / math.sqrt(sampler.n_eff):.2f} (uniform "
    "prior on the box)"
)

mean, std = samples.mean(axis=0), samples.std(axis=0)
print(f"{'parameter':<28} {'fit':>9} {'mean':>9} {'std':>8}")
for name, f, m, sd in zip(dens.names, dens.x0, mean, std, strict=True):
    print(f"{name:<28} {f:9.4f} {m:9.4f} {sd:8.4f}")
k = dens.names.index("mass.components[0].theta_E")
theta_e, theta_sd = mean[k], std[k]
print(f'theta_E = {theta_e:.4f} +- {theta_sd:.4f}" (published 1.38", Bolton et al. 2008)')
# the posterior is narrow against the box (the box did not cut it) and holds the fit
assert np.all(std < 0.2 * (hi - lo)), "the posterior fills its box: widen the box"
assert np.all(np.abs(mean - dens.x0) < 5 * std + 1e-3), "the posterior left the fit"
assert abs(theta_e / 1.38 - 1) < 0.04

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
figure = corner.corner(samples, labels=[n.split(".")[-1] for n in dens.names], show_titles=True)
path = os.path.join(out, "nested_sampling_hst_corner.png")
figure.savefig(path, dpi=60)
print(f"corner plot: {path}")
