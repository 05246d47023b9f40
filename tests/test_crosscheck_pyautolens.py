"""The pixelized evidence against PyAutoLens on identical inputs, term by term.

PyAutoLens needs Python >= 3.12: the `crosscheck-pyautolens` nox session installs it and
runs this file (the other sessions leave it out). With PyAutoLens's definitions chosen in
equilens (docs/pixelized.md, "equilens and PyAutoLens": `RectangularMesh(nodes="centres")`,
`ConstantRegularization.from_pyautolens`, `LogEvidence(map_outside_mask=False,
marginalise_amplitudes=False)`) and PyAutoLens's positive-only solver, border relocation and
diagonal floor for unregularized amplitudes switched off, every term of the log-evidence
agrees to 1e-8 relative (measured: 1.3e-10 or better), on rectangular and Delaunay meshes,
with and without linear lens light, with 2x2 sub-pixels (source only); the reference is
PyAutoLens's dense mapping-matrix path (its default).

Conventions bridged here: PyAutoLens's arrays have their first row at the top (largest y),
equilens's at the bottom, so the data, noise, mask and PSF are flipped upside down for it;
its coordinates are (y, x); its source values are flux per image pixel (equilens: surface
brightness per arcsec^2, so its log dets are larger by `2 n log a` for `n` source pixels of
data pixel area `a`).
"""

import math

import jax
import numpy as np
import pytest

import equilens as el
from equilens import light, mass

al = pytest.importorskip("autolens")

pytestmark = [
    pytest.mark.pyautolens,
    pytest.mark.x64_only,
    # (PyAutoLens pads its mask for the PSF's footprint, and says so)
    pytest.mark.filterwarnings("ignore:Mask padded:UserWarning"),
]

PS = 0.05
TERMS = (
    "chi2",
    "regularization_term",
    "log_det_curvature",
    "log_det_regularization",
    "noise_normalisation",
    "log_evidence",
)
#: The lens's centre: off the grid's centre, so the traced grid has no symmetry (a
#: symmetric one gives cocircular Delaunay nodes, whose triangulation is a tie that qhull
#: breaks by the order of the coordinates).
CENTRE = (0.07, -0.04)
GAUSSIANS = ((0.25, 0.03, -0.02), (0.6, -0.05, 0.04))  # (sigma, x, y) of the lens light


def _kernel() -> np.ndarray:
    # asymmetric, so that a flipped or mirrored convolution would show
    y, x = np.mgrid[-5:6, -5:6] * PS
    k = np.exp(-0.5 * ((x - 0.01) ** 2 / 0.04**2 + (y + 0.02) ** 2 / 0.06**2))
    return k / k.sum()


@pytest.fixture(scope="module")
def imaging() -> el.Imaging:
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.1, center_x=CENTRE[0], center_y=CENTRE[1]),
        lens_light=light.Gaussian(amp=40.0, sigma=0.3, center_x=0.03, center_y=-0.02),
        source=light.Sersic(amp=25.0, R_sersic=0.15, n_sersic=1.5, e1=0.1, center_x=0.05),
    )
    # (the mask and the PSF's footprint around it inside the image: PyAutoLens evaluates
    # light profiles there even beyond the image's edges, equilens on the image alone)
    grid = el.Grid((72, 72), pixel_scale=PS)
    x, y = (np.asarray(c) for c in grid.coordinates())
    mask = np.hypot(x - CENTRE[0], y - CENTRE[1]) < 1.4
    return el.simulate(
        jax.random.key(5),
        truth,
        grid,
        el.PixelPSF(_kernel()),
        exposure_time=2000.0,
        sky_level=0.5,
        mask=mask,
    )


def _supersampled(imaging, sub: int) -> el.Imaging:
    if sub == 1:
        return imaging
    return el.Imaging(
        imaging.data,
        imaging.noise_map,
        el.PixelPSF(_kernel()),
        PS,
        mask=imaging.mask,
        supersampling=sub,
    )


def _equilens(imaging, mesh: str, lens_light: bool, coefficient: float, route: str) -> dict:
    if mesh == "rectangular":
        source_mesh = el.RectangularMesh((18, 18), nodes="centres")
    else:
        source_mesh = _delaunay(imaging)
    ll = None
    if lens_light:
        ll = sum(
            (light.Gaussian(1.0, s, center_x=x, center_y=y) for s, x, y in GAUSSIANS[1:]),
            light.Gaussian(
                1.0, GAUSSIANS[0][0], center_x=GAUSSIANS[0][1], center_y=GAUSSIANS[0][2]
            ),
        )
    reg = el.ConstantRegularization.from_pyautolens(coefficient, PS)
    system = el.LensSystem(
        mass=mass.SIE(theta_E=1.1, center_x=CENTRE[0], center_y=CENTRE[1]),
        lens_light=ll,
        source=el.PixelizedSource(source_mesh, reg),
    )
    term = el.LogEvidence(
        imaging, route=route, map_outside_mask=False, marginalise_amplitudes=False
    )
    inv = term.invert(system)
    return {k: float(getattr(inv, k)) for k in TERMS} | {"n": source_mesh.n_pixels}


def _delaunay(imaging) -> el.DelaunayMesh:
    base = el.DelaunayMesh.from_mask(imaging.grid, np.asarray(imaging.mask), 160)
    # (jittered by up to a fifth of a pixel: no four traced nodes on one circle)
    rng = np.random.default_rng(2)
    shift = rng.uniform(-0.2 * PS, 0.2 * PS, (2, base.n_pixels))
    return el.DelaunayMesh(base.image_x + shift[0], base.image_y + shift[1])


def _pyautolens(imaging, mesh: str, lens_light: bool, coefficient: float, sub: int) -> dict:
    def flipped(a):
        return al.Array2D.no_mask(np.array(a, np.float64)[::-1].copy(), pixel_scales=PS)

    dataset = al.Imaging(
        data=flipped(imaging.data),
        noise_map=flipped(imaging.noise_map),
        psf=al.Convolver(kernel=flipped(_kernel()), normalize=True),
        over_sample_size_lp=sub,
        over_sample_size_pixelization=sub,
    ).apply_mask(mask=al.Mask2D(mask=~np.asarray(imaging.mask)[::-1], pixel_scales=PS))
    lens_parts = {}
    if lens_light:
        for i, (s, x, y) in enumerate(GAUSSIANS):
            lens_parts[f"g{i}"] = al.lp_linear.Gaussian(
                centre=(y, x), ell_comps=(0.0, 0.0), sigma=s
            )
    lens = al.Galaxy(
        redshift=0.5,
        mass=al.mp.Isothermal(centre=(CENTRE[1], CENTRE[0]), einstein_radius=1.1),
        **lens_parts,
    )
    adapt = None
    if mesh == "rectangular":
        pix_mesh = al.mesh.RectangularUniform(shape=(18, 18))
    else:
        nodes = _delaunay(imaging)
        grid = al.Grid2DIrregular(
            np.stack([np.asarray(nodes.image_y), np.asarray(nodes.image_x)], 1)
        )
        pix_mesh = al.mesh.Delaunay(pixels=nodes.n_pixels)
    pix = al.Pixelization(mesh=pix_mesh, regularization=al.reg.Constant(coefficient=coefficient))
    source = al.Galaxy(redshift=1.0, pixelization=pix)
    if mesh != "rectangular":
        adapt = al.AdaptImages(galaxy_image_plane_mesh_grid_dict={source: grid})
    # (PyAutoLens's defaults: a positive-only solve with the mesh's edge pixels fixed at 0,
    # traced pixels beyond the mask's traced border moved onto it, and 1e-3 added to the
    # curvature's diagonal for the unregularized lens-light amplitudes, which moves chi2 by
    # ~1e-7 relative here; equilens has none of these)
    settings = al.Settings(
        use_positive_only_solver=False,
        use_border_relocator=False,
        no_regularization_add_to_curvature_diag_value=0.0,
    )
    fit = al.FitImaging(
        dataset=dataset,
        tracer=al.Tracer(galaxies=[lens, source]),
        settings=settings,
        adapt_images=adapt,
    )
    inv = fit.inversion
    return {
        "chi2": float(fit.chi_squared),
        "regularization_term": float(inv.regularization_term),
        "log_det_curvature": float(inv.log_det_curvature_reg_matrix_term),
        "log_det_regularization": float(inv.log_det_regularization_matrix_term),
        "noise_normalisation": float(fit.noise_normalization),
        "log_evidence": float(fit.log_evidence),
    }


@pytest.mark.parametrize(
    "mesh,coefficient,sub,lens_light",
    [
        ("rectangular", 2.5, 1, False),
        ("rectangular", 2.5, 1, True),
        ("delaunay", 0.7, 1, False),
        ("delaunay", 0.7, 1, True),
        # (with lens light, sub-pixels differ by definition: PyAutoLens evaluates the light
        # outside the mask that the PSF blurs into it at pixel centres, equilens on the
        # sub-pixels of every pixel; 4e-6 in chi2 here)
        ("rectangular", 1.2, 2, False),
    ],
    ids=[
        "rectangular-source-only",
        "rectangular-lens-light",
        "delaunay-source-only",
        "delaunay-lens-light",
        "rectangular-2x2-subpixels-source-only",
    ],
)
def test_every_evidence_term_matches_pyautolens(imaging, mesh, coefficient, sub, lens_light):
    # (`sub`: PyAutoLens's over-sampling of light profiles and of the source mapping,
    # equilens's `Imaging(supersampling=...)`)
    assert jax.config.read("jax_enable_x64")
    theirs = _pyautolens(imaging, mesh, lens_light, coefficient, sub)
    for route in ("dense", "sparse"):
        ours = _equilens(_supersampled(imaging, sub), mesh, lens_light, coefficient, route)
        # equilens's source values are surface brightness: its log dets carry 2 n log a
        shift = 2 * ours["n"] * math.log(PS * PS)
        print(f"\n{mesh} {sub}x{sub}, {'lens light' if lens_light else 'source only'}, {route}:")
        for name in TERMS:
            got = ours[name] - (shift if name.startswith("log_det") else 0.0)
            err = abs(got - theirs[name]) / abs(theirs[name])
            print(f"  {name:24s} {got:20.10f} {theirs[name]:20.10f}  {err:.1e}")
            assert err < 1e-8, (name, got, theirs[name])
