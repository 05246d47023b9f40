"""Four bands of one simulated lens, fitted one by one and jointly.

One SIE + shear lens is "observed" in four bands, as a Euclid-like set: a sharp optical
band (0.05"/pixel, PSF FWHM 0.10") and three infrared bands (0.1"/pixel, FWHM 0.20", 0.25"
and 0.30"), each with its own noise, and the lens galaxy and the source in different
colours (redder lens, bluer source). Each band is fitted alone (a `LensSystem`), then all
four jointly: a `MultiBandLensSystem` with one mass model and the light shared in shape
(position, size, ellipticity, Sersic index) with per-band amplitudes, solved linearly in
each band, and a `MultiBandTerm` summing the four Gaussian likelihoods.

Prints, for each fit, the Einstein radius, its 1-sigma error and its deviation from the
truth; the joint fit must have the smallest error. Writes `multiband_simulated.json` (the
joint fit, per-band amplitudes included) to $EQUILENS_EXAMPLE_OUT (default: the current
folder).

Units: arcsec for angles, electrons/s per pixel for images.
"""

import os
import time

import jax

jax.config.update("jax_enable_x64", True)  # lens models want float64

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

THETA_E = 1.2
lens_mass = mass.SIE(theta_E=THETA_E, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, -0.01)
lens_shape = dict(R_sersic=0.8, n_sersic=3.5, e1=0.05)
source_shape = dict(R_sersic=0.15, n_sersic=1.3, e1=0.1, center_x=0.05)
# name, pixel scale (arcsec), PSF FWHM (arcsec), grid side, lens and source amplitudes
BANDS = [
    ("VIS", 0.05, 0.10, 100, 4.0, 12.0),
    ("Y", 0.10, 0.20, 50, 14.0, 14.0),
    ("J", 0.10, 0.25, 50, 20.0, 12.0),
    ("H", 0.10, 0.30, 50, 26.0, 10.0),
]

bands = []
for k, (_, scale, fwhm, side, lens_amp, source_amp) in enumerate(BANDS):
    truth = el.LensSystem(
        mass=lens_mass,
        lens_light=light.Sersic(amp=lens_amp, **lens_shape),
        source=light.Sersic(amp=source_amp, **source_shape),
    )
    grid = el.Grid((side, side), pixel_scale=scale)
    bands.append(
        el.simulate(
            jax.random.key(k),
            truth,
            grid,
            el.GaussianPSF(fwhm=fwhm, pixel_scale=scale),
            exposure_time=1000.0,
            sky_level=1.0,
            mask=grid.circular_mask(2.4),
        )
    )
data = el.MultiBandImaging(bands, names=[b[0] for b in BANDS])

# A generic start: round profiles at the centre, no shear; amplitudes are solved linearly.
start_mass = mass.SIE(theta_E=1.0) + mass.ExternalShear(0.0, 0.0)
start_lens = light.Sersic(amp=1.0, R_sersic=0.5, n_sersic=4.0)
start_source = light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0)

rows = []
for name, imaging in zip(data.names, data.bands, strict=True):
    t0 = time.perf_counter()
    start = el.LensSystem(start_mass, start_source, start_lens)
    r = el.fit(el.Objective(el.GaussianLikelihood(imaging)), start, "lm", max_steps=500)
    assert r.success, r.message()
    rows.append((name, r, time.perf_counter() - t0))

t0 = time.perf_counter()
joint_start = el.MultiBandLensSystem(
    start_mass, source=start_source, lens_light=start_lens, bands=len(data)
)
joint = el.fit(el.Objective(el.MultiBandTerm.build(data)), joint_start, "lm", max_steps=500)
assert joint.success, joint.message()
rows.append(("joint", joint, time.perf_counter() - t0))

print(f"{'fit':6s} {'theta_E':>9s} {'1-sigma':>9s} {'deviation':>10s} {'chi2/dof':>9s}  time")
for name, r, seconds in rows:
    theta = float(r.model.mass.components[0].theta_E)
    print(
        f"{name:6s} {theta:9.5f} {float(r.errors[0]):9.5f} {theta - THETA_E:+10.5f} "
        f"{float(r.reduced_chi2):9.3f}  {seconds:.1f} s"
    )
print("\nper-band amplitudes of the joint fit (lens light, source):")
for k, name in enumerate(data.names):
    lens_amp, source_amp = BANDS[k][4], BANDS[k][5]
    print(
        f"  {name:4s} {float(joint.model.lens_light[k].amp):7.3f} (truth {lens_amp:5.1f})  "
        f"{float(joint.model.source[k].amp):7.3f} (truth {source_amp:5.1f})"
    )

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
el.solve.write_json(os.path.join(out, "multiband_simulated.json"), joint, data.names)

errors = {name: float(r.errors[0]) for name, r, _ in rows}
assert errors["joint"] < min(v for k, v in errors.items() if k != "joint"), errors
theta = float(joint.model.mass.components[0].theta_E)
assert abs(theta - THETA_E) < 4 * errors["joint"], (theta, errors["joint"])
