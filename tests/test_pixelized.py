"""Pixelized sources: the inversion and log-evidence against an independent dense NumPy
implementation, round-off reconstruction, gradients, evidence scans and bad input."""

import concurrent.futures
import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.ndimage
import scipy.optimize
import scipy.signal
from scipy.spatial import Delaunay

import equilens as el
from equilens import light, mass
from equilens.regularization import AbstractRegularization
from equilens.regularization._regularization import RIDGE
from helpers import fd_grad, rel_err, slow_ci

X64 = jax.config.read("jax_enable_x64")
PS = 0.05


def _lens():
    return mass.SIE(theta_E=0.9, e1=0.08, e2=-0.04) + mass.ExternalShear(gamma1=0.03, gamma2=0.01)


@pytest.fixture(scope="module")
def dataset():
    truth = el.LensSystem(
        mass=_lens(),
        lens_light=light.Sersic(amp=6.0, R_sersic=0.5, n_sersic=2.5),
        source=light.Sersic(amp=30.0, R_sersic=0.12, n_sersic=1.2, e1=0.1, center_x=0.04),
    )
    grid = el.Grid((44, 44), pixel_scale=PS)
    psf = el.GaussianPSF(fwhm=0.11, pixel_scale=PS, truncation=3.0)
    return el.simulate(
        jax.random.key(3),
        truth,
        grid,
        psf,
        exposure_time=1500.0,
        sky_level=1.0,
        mask=grid.circular_mask(1.0),
    )


def _system(mesh, reg, lens_light=True):
    ll = light.Sersic(amp=1.0, R_sersic=0.5, n_sersic=2.5) if lens_light else None
    return el.LensSystem(mass=_lens(), lens_light=ll, source=el.PixelizedSource(mesh, reg))


# -- an independent dense NumPy implementation ------------------------------------------------


def _np_weighted_quantile(v, w, q):
    """Weighted quantiles of `v`: for each `q`, the smallest value whose cumulative weight
    (values in increasing order) reaches `q` of the total."""
    order = np.argsort(v, kind="stable")
    vs, ws = v[order], w[order]
    total = ws.sum()
    out = []
    for qi in q:
        reached = 0.0
        for value, weight in zip(vs, ws, strict=True):
            reached += weight
            if reached >= qi * total * (1 - 1e-12):
                out.append(value)
                break
        else:
            out.append(vs[-1])
    return np.asarray(out)


def _np_mapping(system, imaging, outside=True, adapt=None):
    """Dense blurred mapping (n_pixels_full x n_source) and the traced node geometry
    (`outside`: the source mapped to the mask grown by the kernel, or to the mask alone)."""
    grid = imaging.grid
    ny, nx = grid.shape
    s = grid.supersampling
    kernel = np.asarray(imaging.psf.kernel(), np.float64)
    ky, kx = kernel.shape
    mask = np.asarray(imaging.mask)
    # pixels within a kernel half-width (box) of the mask
    rows, cols = np.nonzero(mask)
    near = np.zeros_like(mask)
    for r, c in zip(rows, cols, strict=True):
        near[max(r - ky // 2, 0) : r + ky // 2 + 1, max(c - kx // 2, 0) : c + kx // 2 + 1] = True
    if not outside:
        near = mask
    xs, ys = (np.asarray(a, np.float64) for a in grid.coordinates(supersampled=True))
    sub_pix = (np.arange(ny * s)[:, None] // s) * nx + (np.arange(nx * s)[None, :] // s)
    use = near.reshape(-1)[sub_pix]
    bx, by = (
        np.asarray(a, np.float64)
        for a in system.mass.ray_shoot(jnp.asarray(xs[use]), jnp.asarray(ys[use]))
    )
    pix = sub_pix[use]
    src = system.source
    mesh = src.mesh
    area = grid.pixel_area / s**2
    if isinstance(mesh, el.DelaunayMesh):
        nodes = np.stack(
            [np.asarray(a, np.float64) for a in system.mass.ray_shoot(mesh.image_x, mesh.image_y)],
            1,
        )
        tri = Delaunay(nodes)
        simplex = tri.find_simplex(np.stack([bx, by], 1))
        n_src = nodes.shape[0]
        m = np.zeros((ny * nx, n_src))
        for i in range(bx.size):
            if simplex[i] < 0:
                j = np.argmin((nodes[:, 0] - bx[i]) ** 2 + (nodes[:, 1] - by[i]) ** 2)
                m[pix[i], j] += area
                continue
            t = tri.transform[simplex[i]]
            lam = t[:2] @ (np.array([bx[i], by[i]]) - t[2])
            bary = np.array([lam[0], lam[1], 1 - lam.sum()])
            for v, b in zip(tri.simplices[simplex[i]], bary, strict=True):
                m[pix[i], v] += area * b
        edges = set()
        for simp in tri.simplices:
            for a, b in ((0, 1), (1, 2), (2, 0)):
                edges.add(tuple(sorted((simp[a], simp[b]))))
        geo = {"nodes": nodes, "edges": sorted(edges), "kind": "tri"}
    else:
        shape = mesh.shape
        if isinstance(mesh, el.AdaptiveRectangularMesh) and mesh.weight_floor is not None:
            # nodes at brightness-weighted quantiles: the adapt image at each sub-pixel
            b = np.maximum(np.asarray(imaging.data if adapt is None else adapt).ravel()[pix], 0)
            w = mesh.weight_floor + (b / b.max()) ** mesh.weight_power
            gx = _np_weighted_quantile(bx, w, np.linspace(0, 1, shape[1]))
            gy = _np_weighted_quantile(by, w, np.linspace(0, 1, shape[0]))
        elif isinstance(mesh, el.AdaptiveRectangularMesh):
            gx = np.quantile(bx, np.linspace(0, 1, shape[1]))
            gy = np.quantile(by, np.linspace(0, 1, shape[0]))
        elif mesh.nodes == "centres":
            # cells tiling the box widened by 1e-8 arcsec; extrapolated beyond the outer nodes
            # (tx, ty below are not clipped)
            x0, x1, y0, y1 = bx.min() - 1e-8, bx.max() + 1e-8, by.min() - 1e-8, by.max() + 1e-8
            gx = x0 + (np.arange(shape[1]) + 0.5) * (x1 - x0) / shape[1]
            gy = y0 + (np.arange(shape[0]) + 0.5) * (y1 - y0) / shape[0]
        else:
            gx = np.linspace(bx.min(), bx.max(), shape[1])
            gy = np.linspace(by.min(), by.max(), shape[0])
        n_src = shape[0] * shape[1]
        m = np.zeros((ny * nx, n_src))
        for i in range(bx.size):
            ix = min(max(np.searchsorted(gx, bx[i], side="right") - 1, 0), shape[1] - 2)
            iy = min(max(np.searchsorted(gy, by[i], side="right") - 1, 0), shape[0] - 2)
            tx = (bx[i] - gx[ix]) / (gx[ix + 1] - gx[ix])
            ty = (by[i] - gy[iy]) / (gy[iy + 1] - gy[iy])
            for dy, dx, wgt in ((0, 0, (1 - tx) * (1 - ty)), (0, 1, tx * (1 - ty))):
                m[pix[i], (iy + dy) * shape[1] + ix + dx] += area * wgt
            for dy, dx, wgt in ((1, 0, (1 - tx) * ty), (1, 1, tx * ty)):
                m[pix[i], (iy + dy) * shape[1] + ix + dx] += area * wgt
        yy, xx = np.meshgrid(gy, gx, indexing="ij")
        ids = np.arange(n_src).reshape(shape)
        edges = [(ids[r, c], ids[r, c + 1]) for r in range(shape[0]) for c in range(shape[1] - 1)]
        edges += [(ids[r, c], ids[r + 1, c]) for r in range(shape[0] - 1) for c in range(shape[1])]
        geo = {"nodes": np.stack([xx.ravel(), yy.ravel()], 1), "edges": edges, "kind": "rect"}
        geo["lines"] = [
            (ids[r, c - 1], ids[r, c], ids[r, c + 1])
            for r in range(shape[0])
            for c in range(1, shape[1] - 1)
        ] + [
            (ids[r - 1, c], ids[r, c], ids[r + 1, c])
            for r in range(1, shape[0] - 1)
            for c in range(shape[1])
        ]
    blurred = np.stack(
        [
            scipy.signal.convolve2d(m[:, j].reshape(ny, nx), kernel, mode="same").ravel()
            for j in range(n_src)
        ],
        1,
    )
    return blurred, m, geo


def _np_regularization(reg, geo, signal):
    n = geo["nodes"].shape[0]
    if isinstance(reg, el.ConstantRegularization | el.CurvatureRegularization):
        lam = float(reg.coefficient)
        h = np.zeros((n, n))
        if isinstance(reg, el.ConstantRegularization):
            for i, j in geo["edges"]:
                row = np.zeros(n)
                row[i], row[j] = 1.0, -1.0
                h += np.outer(row, row)
        elif geo["kind"] == "rect":
            for a, b, c in geo["lines"]:
                row = np.zeros(n)
                row[a], row[b], row[c] = 1.0, -2.0, 1.0
                h += np.outer(row, row)
        else:
            lap = np.zeros((n, n))
            for i, j in geo["edges"]:
                lap[i, i] += 1
                lap[j, j] += 1
                lap[i, j] -= 1
                lap[j, i] -= 1
            h = lap.T @ lap
        ridge = reg.ridge if isinstance(reg, el.ConstantRegularization) else RIDGE
        return lam * (h + ridge * np.eye(n))
    if isinstance(reg, el.AdaptiveBrightness):
        sig = np.clip(signal, reg.signal_floor, 1) ** float(reg.signal_scale)
        inner, outer = float(reg.inner_coefficient), float(reg.outer_coefficient)
        w = (inner * sig + outer * (1 - sig)) ** 2
        h = RIDGE * np.diag(w)
        for i, j in geo["edges"]:
            row = np.zeros(n)
            row[i], row[j] = 1.0, -1.0
            h += 0.5 * (w[i] + w[j]) * np.outer(row, row)
        return h
    nodes = geo["nodes"]
    d = np.sqrt(((nodes[:, None, :] - nodes[None, :, :]) ** 2).sum(-1))
    r = d / float(reg.scale)
    nu = getattr(reg, "nu", 0.5)
    if nu == 0.5:
        k = np.exp(-r)
    elif nu == 1.5:
        k = (1 + math.sqrt(3) * r) * np.exp(-math.sqrt(3) * r)
    else:
        k = (1 + math.sqrt(5) * r + 5 * r**2 / 3) * np.exp(-math.sqrt(5) * r)
    k = k + reg.jitter * np.eye(n)
    return float(reg.coefficient) * np.linalg.inv(k)


def np_log_evidence(system, imaging, adapt=None, outside=True, marginalise=True, with_scale=False):
    """-(chi2 + s^T H s + log det(F+H) - log det H + sum log 2 pi sigma^2)/2, dense
    (`marginalise=False`: log det of the source block of F+H alone), and the source.
    `with_scale`: also half the sum of the five terms' magnitudes, the scale of the
    round-off of a log-evidence that is their sum (a comparison to 1e-10 of it is one to
    1e-10 of each term, however much they cancel)."""
    blurred, m, geo = _np_mapping(system, imaging, outside, adapt)
    mask = np.asarray(imaging.mask).reshape(-1)
    sigma = np.asarray(imaging.noise_map, np.float64).reshape(-1)[mask]
    data = np.asarray(imaging.data, np.float64).reshape(-1)[mask]
    cols = [blurred[mask]]
    n_lin = 0
    if system.lens_light is not None:
        images, _ = system.linear_images(imaging.grid, imaging.psf, fields=("lens_light",))
        lin = np.asarray(images, np.float64).reshape(images.shape[0], -1)[:, mask].T
        n_lin = lin.shape[1]
        cols.insert(0, lin)
    a_mat = np.concatenate(cols, 1) / sigma[:, None]
    f = a_mat.T @ a_mat
    d = a_mat.T @ (data / sigma)
    adapt_img = np.asarray(imaging.data if adapt is None else adapt, np.float64).reshape(-1)
    total = m.T @ np.maximum(adapt_img, 0)
    cover = m.T @ np.ones_like(adapt_img)
    signal = np.where(cover > 0, total / np.where(cover > 0, cover, 1), 0)
    signal = signal / signal.max()
    h_src = _np_regularization(system.source.regularization, geo, signal)
    h = np.zeros_like(f)
    h[n_lin:, n_lin:] = h_src
    x = np.linalg.solve(f + h, d)
    model = a_mat @ x * sigma
    chi2 = np.sum(((data - model) / sigma) ** 2)
    s = x[n_lin:]
    logdet_a = np.linalg.slogdet((f + h) if marginalise else (f + h)[n_lin:, n_lin:])[1]
    logdet_h = np.linalg.slogdet(h_src)[1]
    norm = np.sum(np.log(2 * np.pi * sigma**2))
    terms = np.array([chi2, s @ h_src @ s, logdet_a, -logdet_h, norm])
    value = -0.5 * float(np.sum(terms))
    return (value, s, 0.5 * float(np.sum(np.abs(terms)))) if with_scale else (value, s)


# Compiled once per module (tests of one term and system structure share the programs):
# eagerly, every primitive of a log-evidence is compiled and dispatched on its own.
_INVERT = eqx.filter_jit(lambda t, s, errors: t.invert(s, errors=errors))
_VALUE = eqx.filter_jit(lambda t, s: t(s))
_INVERT_AND_VALUE = eqx.filter_jit(lambda t, s: (t.invert(s), t(s)))


def _invert(term, system, errors=False):
    return _INVERT(term, system, errors)


CASES = [
    ("rect", "constant", "dense", True),
    ("rect", "constant", "sparse", True),
    ("adaptive", "adaptive", "sparse", False),
    ("delaunay", "matern", "sparse", True),
    ("rect", "constant", "w_tilde", True),
    ("rect", "curvature", "w_tilde", False),
    ("rect", "adaptive", "dense", False),
    ("adaptive", "matern", "dense", True),
    ("adaptive", "curvature", "w_tilde", False),
    ("delaunay", "constant", "w_tilde", False),
    ("delaunay", "curvature", "dense", False),
    ("delaunay", "exponential", "dense", True),
    ("brightness", "constant", "sparse", True),
    ("brightness", "adaptive", "dense", False),
]


def _mesh(name, imaging):
    if name == "rect":
        return el.RectangularMesh((10, 12))
    if name == "adaptive":
        return el.AdaptiveRectangularMesh((11, 11))
    if name == "brightness":
        return el.AdaptiveRectangularMesh((11, 11), weight_floor=0.1)
    return el.DelaunayMesh.from_mask(imaging.grid, np.asarray(imaging.mask), 110)


def _reg(name):
    return {
        "constant": el.ConstantRegularization(2e-3),
        "curvature": el.CurvatureRegularization(5e-3),
        "adaptive": el.AdaptiveBrightness(1e-2, 0.1, 1.0),
        "matern": el.MaternKernel(1e-3, 0.1, nu=2.5),
        "exponential": el.ExponentialKernel(1e-3, 0.15),
    }[name]


@pytest.mark.x64_only
@pytest.mark.parametrize("mesh,reg,route,lens_light", CASES)
def test_log_evidence_matches_dense_numpy(dataset, mesh, reg, route, lens_light):
    system = _system(_mesh(mesh, dataset), _reg(reg), lens_light)
    term = el.LogEvidence(dataset, route=route)
    inv, value = _INVERT_AND_VALUE(term, system)
    ref, s_ref, scale = np_log_evidence(system, dataset, with_scale=True)
    assert inv.route == route
    assert bool(inv.valid)
    assert abs(float(inv.log_evidence) - ref) <= 1e-10 * scale
    assert rel_err(inv.values, s_ref) < 1e-8
    assert float(value) == pytest.approx(-ref, abs=1e-10 * scale)


@pytest.mark.x64_only
@pytest.mark.parametrize(
    "mesh,route,lens_light",
    [
        ("rect", "dense", True),
        ("rect", "sparse", True),
        ("rect", "w_tilde", False),
        ("delaunay", "sparse", True),
        ("delaunay", "w_tilde", True),
        ("delaunay", "dense", False),
    ],
)
def test_pyautolens_options_match_dense_numpy(dataset, mesh, route, lens_light):
    # PyAutoLens's definitions (docs/pixelized.md, "equilens and PyAutoLens"): nodes at the
    # cell centres with extrapolation, its coefficient and ridge, the source mapped to the
    # mask alone, the amplitudes held at their solved values (source-block log det)
    if mesh == "rect":
        m = el.RectangularMesh((10, 12), nodes="centres")
    else:
        m = _mesh("delaunay", dataset)
    system = _system(m, el.ConstantRegularization.from_pyautolens(1.7, PS), lens_light)
    term = el.LogEvidence(
        dataset, route=route, map_outside_mask=False, marginalise_amplitudes=False
    )
    inv, value = _INVERT_AND_VALUE(term, system)
    ref, s_ref, scale = np_log_evidence(
        system, dataset, outside=False, marginalise=False, with_scale=True
    )
    assert bool(inv.valid)
    # (to 1e-10 of the terms' magnitudes, as above: with jax 0.12.1 the rectangular cases
    # differ by 4.9e-8, 1.03e-10 of their sum, -470.2, and 4e-12 of the terms' 11,303)
    assert abs(float(inv.log_evidence) - ref) <= 1e-10 * scale
    assert rel_err(inv.values, s_ref) < 1e-8
    assert float(value) == pytest.approx(-ref, abs=1e-10 * scale)
    # each option changes the evidence (so each is tested above)
    default = np_log_evidence(system, dataset)[0]
    assert abs(default - ref) > 1e-6 * abs(ref)
    if lens_light:
        outside = np_log_evidence(system, dataset, outside=False)[0]
        assert abs(outside - ref) > 0.1


def test_centred_rectangular_nodes_extrapolate_linear_functions_over_their_box():
    tol = 1e-12 if X64 else 1e-5
    rng = np.random.default_rng(0)
    x = jnp.asarray(np.concatenate([rng.uniform(-0.7, 1.1, 500), [-0.7, 1.1, -0.7, 1.1]]))
    y = jnp.asarray(np.concatenate([rng.uniform(-0.4, 0.9, 500), [-0.4, 0.9, 0.9, -0.4]]))
    geo = el.RectangularMesh((6, 9), nodes="centres").geometry(_lens(), x, y)
    xs, ys = np.asarray(geo.xs), np.asarray(geo.ys)
    # centres of 9 x 6 cells tiling the box (widened by 1e-8 arcsec)
    np.testing.assert_allclose(np.diff(xs), (1.8 + 2e-8) / 9, rtol=tol)
    np.testing.assert_allclose([xs[0], ys[-1]], [-0.7 + 0.1, 0.9 - 1.3 / 12], atol=max(tol, 1e-7))
    w = geo.interpolation(x, y)[1]
    np.testing.assert_allclose(np.sum(np.asarray(w), axis=1), 1.0, rtol=tol)
    assert np.min(np.asarray(w)) < -0.1  # (the corners are extrapolated)
    # bilinear interpolation is exact for a linear function, extrapolated or not
    nodes = np.asarray(geo.nodes())
    values = jnp.asarray(0.3 + 1.7 * nodes[:, 0] - 0.6 * nodes[:, 1])
    got = np.asarray(geo.values_at(values, x, y))
    np.testing.assert_allclose(got, 0.3 + 1.7 * np.asarray(x) - 0.6 * np.asarray(y), atol=tol)
    # with fixed bounds, points beyond the box (half a spacing past the outer nodes) get none
    fixed = el.RectangularMesh((6, 9), bounds=(-0.7, 1.1, -0.4, 0.9), nodes="centres")
    g2 = fixed.geometry(_lens(), x, y)
    far = jnp.asarray([1.101, -0.701, 0.2]), jnp.asarray([0.2, 0.2, 0.901])
    np.testing.assert_array_equal(np.asarray(g2.interpolation(*far)[1]), 0.0)
    near = jnp.asarray([1.1 - 1e-9]), jnp.asarray([0.9 - 1e-9])
    assert float(jnp.sum(g2.interpolation(*near)[1])) == pytest.approx(1.0, rel=tol)


def test_pyautolens_constant_regularization_conversion():
    tol = 1e-12 if X64 else 1e-6
    reg = el.ConstantRegularization.from_pyautolens(3.0, 0.05)
    assert float(reg.coefficient) == pytest.approx((0.05**2 * 3.0) ** 2, rel=tol)
    assert reg.ridge == pytest.approx(1e-8 / 9.0, rel=1e-14)  # (a Python float)
    # lambda (G^T G + ridge I) = a^2 (c^2 G^T G + 1e-8 I): PyAutoLens's H in its units
    geo = el.RectangularMesh((4, 5)).placeholder()
    h, logdet = reg.matrix(geo, jnp.zeros(20))
    g = np.asarray(el.ConstantRegularization(1.0).matrix(geo, jnp.zeros(20))[0], np.float64)
    g = np.round(g)  # (G^T G has integer entries; H(1) adds the ridge)
    theirs = 9.0 * g + 1e-8 * np.eye(20)
    np.testing.assert_allclose(np.asarray(h), 0.05**4 * theirs, rtol=1e3 * tol, atol=1e-24)
    # (the ridge-sized eigenvalue is known to ~1e-8 relative from a dense slogdet)
    want = np.linalg.slogdet(0.05**4 * theirs)[1]
    assert float(logdet) == pytest.approx(want, abs=1e-6 if X64 else 1e-2)
    for bad in (
        {"coefficient": 0.0, "pixel_scale": 0.05},
        {"coefficient": 1.0, "pixel_scale": -1.0},
    ):
        with pytest.raises(ValueError, match="must be finite and in"):
            el.ConstantRegularization.from_pyautolens(**bad)
    with pytest.raises(ValueError, match=r"ConstantRegularization\.ridge"):
        el.ConstantRegularization(1.0, ridge=0.0)
    with pytest.raises(ValueError, match=r"RectangularMesh\.nodes"):
        el.RectangularMesh((4, 4), nodes="middle")


@pytest.mark.parametrize("route", ["w_tilde", "sparse"])
def test_routes_agree_in_any_precision(dataset, route):
    system = _system(_mesh("rect", dataset), _reg("constant"))
    dense = _invert(el.LogEvidence(dataset, route="dense"), system)
    other = _invert(el.LogEvidence(dataset, route=route), system)
    assert other.route == route
    tol = 1e-11 if X64 else 1e-4
    assert abs(float(dense.log_evidence - other.log_evidence)) <= tol * abs(
        float(dense.log_evidence)
    )
    assert rel_err(dense.model_image, other.model_image) < (1e-9 if X64 else 1e-3)


@pytest.mark.precision_independent
def test_auto_route_is_sparse_on_cpu_and_dense_on_accelerators(dataset):
    term = el.LogEvidence(dataset)
    on_cpu = jax.default_backend() == "cpu"
    assert term.route_for(120, 4) == ("sparse" if on_cpu else "dense")
    assert [r.name for r in term.routes()] == (["sparse"] if on_cpu else ["dense"])
    assert [r.name for r in el.LogEvidence(dataset, route="dense").routes()] == ["dense"]


@pytest.mark.precision_independent
def test_sparse_route_without_numba_is_a_clear_error(dataset, monkeypatch):
    from equilens.numba import SparseRoute

    monkeypatch.setattr(SparseRoute, "available", classmethod(lambda cls: False))
    with pytest.raises(ImportError, match="numba"):
        el.LogEvidence(dataset, route="sparse")
    term = el.LogEvidence(dataset)
    assert "sparse" not in [r.name for r in term.routes()]
    assert term.route_for(120, 4) in ("w_tilde", "dense")


class _TransposedDenseRoute(el.inversion.AbstractRoute):
    # a route of a user's own: F, D and E_L from the dense blurred mapping, formed as
    # (C^T)^T (C^T) from its transpose (a different order of operations than "dense")
    name: ClassVar[str] = "transposed_dense"
    host: ClassVar[bool] = False

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def prepare(cls, data: el.inversion.RouteData) -> "_TransposedDenseRoute":
        del data
        return cls()

    def cost(self, n_source: int, n_weights: int, n_pixels: int) -> float:
        return 1.0

    def solve(self, problem: el.inversion.LinearProblem, errors: bool) -> el.inversion.Solved:
        p = problem
        ny, nx = p.convolution.image_shape
        blurred = el.inversion.blur_mapping(p.idx, p.w, p.n_source, p.mapped, p.convolution)
        ct = (blurred.reshape(p.n_source, ny * nx)[:, p.pixels] * p.inv_sigma[None, :]).T
        return p.solve(ct.T @ ct, ct.T @ p.target, ct.T @ p.light.T)


@pytest.mark.precision_independent
def test_a_registered_route_is_taken_by_name_and_gives_the_dense_evidence(dataset, monkeypatch):
    from equilens.inversion import _routes

    monkeypatch.setattr(_routes, "_REGISTERED", dict(_routes._REGISTERED))
    assert "transposed_dense" not in el.inversion.route_names()
    with pytest.raises(ValueError, match="route must be one of"):
        el.LogEvidence(dataset, route="transposed_dense")
    el.inversion.register_route(_TransposedDenseRoute)
    assert "transposed_dense" in el.inversion.route_names()
    with pytest.raises(ValueError, match="already registered"):
        el.inversion.register_route(
            type("Other", (_TransposedDenseRoute,), {"name": "dense"})  # a second "dense"
        )
    with pytest.raises(TypeError, match="RectangularMesh"):
        el.inversion.register_route(el.RectangularMesh)  # type: ignore[arg-type]
    system = _system(_mesh("rect", dataset), _reg("constant"))
    term = el.LogEvidence(dataset, route="transposed_dense")
    inv = _invert(term, system)
    dense = _invert(el.LogEvidence(dataset, route="dense"), system)
    assert inv.route == "transposed_dense"
    assert term.route_for(120, 4) == "transposed_dense"
    tol = 1e-11 if X64 else 1e-4
    assert abs(float(inv.log_evidence - dense.log_evidence)) <= tol * abs(float(dense.log_evidence))
    # and for one call, on a term prepared for another route
    dense_route = eqx.filter_jit(lambda t, s: t.invert(s, route="dense"))
    assert dense_route(term, system).route == "dense"
    w_tilde_route = eqx.filter_jit(lambda t, s: t.invert(s, route="w_tilde"))
    with pytest.raises(ValueError, match="needs LogEvidence"):
        w_tilde_route(el.LogEvidence(dataset, route="dense"), system)


@pytest.mark.precision_independent
def test_auto_route_chooses_between_dense_and_w_tilde_by_cost(dataset):
    inv = el.inversion
    pixels = np.asarray(el.LogEvidence(dataset, route="dense").pixels)
    mask = np.asarray(dataset.mask)
    kernel = np.asarray(dataset.psf.kernel())
    data = inv.RouteData(
        kernel=kernel,
        weight=np.where(mask, 1.0 / np.asarray(dataset.noise_map) ** 2, 0.0),
        pixels=pixels,
        mapped=inv.mapped_pixels(mask, kernel.shape),
        dtype=np.dtype(np.float64),
        platform="cpu-without-numba",
    )
    # (a platform other than "cpu": dense alone, as on an accelerator)
    assert [r.name for r in inv.AutoRoute.prepare(data).routes] == ["dense"]
    auto = inv.AutoRoute((inv.DenseRoute(), inv.WTildeRoute.prepare(data)))
    n = pixels.size
    small, large = auto.choose(4, 4, n), auto.choose(2000, 4, n)
    assert (small.name, large.name) == ("dense", "w_tilde")
    w_tilde = auto.routes[1]
    assert w_tilde.cost(2000, 4, n) < auto.routes[0].cost(2000, 4, n)


@pytest.mark.x64_only
@pytest.mark.parametrize("route", ["dense", "w_tilde", "sparse"])
def test_asymmetric_psf_matches_numpy(route):
    # every route must convolve (not correlate) with the kernel: a lopsided PSF tells
    grid = el.Grid((40, 40), pixel_scale=PS)
    rng = np.random.default_rng(5)
    kernel = rng.uniform(0.0, 1.0, (7, 5)) * np.linspace(1.0, 3.0, 5)[None, :]
    kernel[:2] *= 0.2
    psf = el.PixelPSF(kernel / kernel.sum())
    data = rng.normal(size=grid.shape) + 3.0
    imaging = el.Imaging(data, np.full(grid.shape, 0.7), psf, PS, mask=grid.circular_mask(0.85))
    system = _system(el.RectangularMesh((9, 8)), el.ConstantRegularization(0.05))
    inv = _invert(el.LogEvidence(imaging, route=route), system)
    ref, s_ref = np_log_evidence(system, imaging)
    assert abs(float(inv.log_evidence) - ref) <= 1e-10 * abs(ref)
    assert rel_err(inv.values, s_ref) < 1e-8


@pytest.mark.slow  # dense and sparse Hessians (50 s)
@pytest.mark.x64_only
def test_sparse_route_forward_mode_and_hessian_match_the_dense_route(dataset):
    system = _system(_mesh("rect", dataset), _reg("constant"))

    def build(term, p):
        m = eqx.tree_at(
            lambda s: (s.mass.components[0].theta_E, s.mass.components[0].e1),
            system,
            (p[0], p[1]),
        )
        return term(m)

    sparse = el.LogEvidence(dataset, route="sparse")
    dense = el.LogEvidence(dataset, route="dense")
    p0 = jnp.asarray([0.9, 0.08])
    v = jnp.asarray([0.3, -1.0])
    # (every derivative compiled once: eagerly, the dense route's Hessian runs op by op)
    grad_dense = eqx.filter_jit(jax.grad(lambda p: build(dense, p)))
    g_dense = grad_dense(p0)
    g_sparse = eqx.filter_jit(jax.grad(lambda p: build(sparse, p)))(p0)
    jvp_sparse = eqx.filter_jit(lambda p, v: jax.jvp(lambda q: build(sparse, q), (p,), (v,))[1])(
        p0, v
    )
    assert rel_err(g_sparse, g_dense) < 1e-8
    assert float(jvp_sparse) == pytest.approx(float(g_dense @ v), rel=1e-8)
    h_dense = eqx.filter_jit(jax.hessian(lambda p: build(dense, p)))(p0)
    h_sparse = eqx.filter_jit(jax.hessian(lambda p: build(sparse, p)))(p0)
    assert rel_err(h_sparse, h_dense) < 1e-8
    # a batch of gradients (vmap over the host kernels)
    batch = jnp.stack([p0, p0 + 0.01])
    g_batch = eqx.filter_jit(jax.vmap(jax.grad(lambda p: build(sparse, p))))(batch)
    g_second = grad_dense(batch[1])
    assert rel_err(g_batch[0], g_dense) < 1e-8
    assert rel_err(g_batch[1], g_second) < 1e-8


@pytest.mark.parametrize(
    "mesh,reg",
    [
        ("rect", "constant"),
        # (the host pass runs in float64 whatever JAX's precision: one case checks the
        # float32 program around it; the other meshes, 8-15 s each, in slow-ci)
        pytest.param("adaptive", "adaptive", marks=[pytest.mark.slow, pytest.mark.ci]),
        pytest.param("brightness", "constant", marks=[pytest.mark.slow, pytest.mark.ci]),
        pytest.param("delaunay", "constant", marks=[pytest.mark.slow, pytest.mark.ci]),
        pytest.param("delaunay", "matern", marks=[pytest.mark.slow, pytest.mark.ci]),
    ],
)
def test_sparse_route_gradient_matches_the_dense_route_in_every_parameter(
    dataset, mesh, reg, monkeypatch
):
    # the sparse route solves in one host call (curvature, regularization and linear
    # light assembled there): its reverse-mode rule against JAX's derivative of the dense
    # route, in the mass, the regularization and the linear lens light's shape
    from equilens.numba import _host_linalg

    needed = []
    real = _host_linalg._system_bwd_host

    def spy(*args, need, **kwargs):
        needed.append(need)
        return real(*args, need=need, **kwargs)

    monkeypatch.setattr(_host_linalg, "_system_bwd_host", spy)
    system = _system(_mesh(mesh, dataset), _reg(reg), lens_light=True)
    params, static = eqx.partition(system, eqx.is_inexact_array)
    free = jax.tree.map(lambda _: True, params)
    free = eqx.tree_at(lambda s: (s.lens_light.amp, s.source.values), free, (False, False))
    params = eqx.filter(params, free)

    sparse = el.LogEvidence(dataset, route="sparse")
    dense = el.LogEvidence(dataset, route="dense")

    def loss(term, p):
        return term(eqx.combine(p, static))

    grad = eqx.filter_jit(jax.grad(loss, argnums=1))
    g_sparse = grad(sparse, params)
    g_dense = grad(dense, params)
    flat_s = jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(g_sparse)])
    flat_d = jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(g_dense)])
    assert int(jnp.sum(flat_d != 0.0)) >= 8
    assert rel_err(flat_s, flat_d) < (1e-8 if X64 else 2e-2)
    assert "w" in needed[-1] and "gram" in needed[-1]
    # only the regularization strength differentiated: only the regularization's
    # cotangent is formed on the host (not the tile kernels' nor the linear light's)
    lam = lambda s: s.source.regularization
    only = eqx.filter(params, eqx.tree_at(lam, jax.tree.map(lambda _: False, free), True))
    rest = eqx.filter(params, eqx.tree_at(lam, jax.tree.map(lambda _: True, free), False))
    g_reg = eqx.filter_jit(jax.grad(lambda t, p: loss(t, eqx.combine(p, rest)), argnums=1))(
        sparse, only
    )
    assert needed[-1] == ("reg",)
    assert rel_err(jnp.stack(jax.tree.leaves(g_reg)), jnp.stack(jax.tree.leaves(lam(g_dense)))) < (
        1e-8 if X64 else 2e-2
    )


@pytest.mark.parametrize("mesh", ["rect", "delaunay"])
def test_regularization_entries_are_its_matrix(dataset, mesh):
    # the sparse form of each built-in regularization is its dense matrix (the same log
    # det), and its products are the dense ones; a dense Gaussian process and the
    # curvature of a triangulation have none
    geometry = _invert(
        el.LogEvidence(dataset, route="dense"), _system(_mesh(mesh, dataset), _reg("constant"))
    ).geometry
    n = geometry.n_pixels
    rng = np.random.default_rng(5)
    signal = jnp.asarray(rng.uniform(0.0, 1.0, n))
    x = jnp.asarray(rng.normal(size=n))
    tol = 1e-12 if X64 else 1e-5
    names = ["constant", "curvature", "adaptive", "matern"]
    with_entries = {"constant", "adaptive"} | ({"curvature"} if mesh == "rect" else set())
    for name in names:
        reg = _reg(name)
        sparse = reg.sparse_matrix(geometry, signal)
        if name not in with_entries:
            assert sparse is None
            continue
        assert sparse is not None
        entries, logdet = sparse
        h, logdet_dense = reg.matrix(geometry, signal)
        assert isinstance(entries, el.source.SparseSymmetric)
        assert rel_err(entries.todense(), h) < tol
        # (the same value; in float32 the ridge makes a dense log det NaN for both)
        np.testing.assert_allclose(float(logdet), float(logdet_dense), rtol=tol)
        assert rel_err(entries.matvec(x), h @ x) < tol
        assert float(entries.quadratic(x)) == pytest.approx(float(x @ h @ x), rel=1e-6)


class _Doubled(el.ConstantRegularization):
    # a built-in with `matrix` overridden (and not `sparse_matrix`): its matrix is used
    def matrix(self, geometry, signal):
        h, logdet = super().matrix(geometry, signal)
        return 2.0 * h, logdet + h.shape[0] * jnp.log(2.0)


@pytest.mark.precision_independent
@pytest.mark.parametrize("route", ["dense", "sparse"])
def test_overriding_only_the_dense_matrix_is_not_bypassed(dataset, route):
    term = el.LogEvidence(dataset, route=route)
    doubled = _VALUE(term, _system(_mesh("rect", dataset), _Doubled(1e-3), lens_light=False))
    direct = _VALUE(term, _system(_mesh("rect", dataset), el.ConstantRegularization(2e-3), False))
    single = _VALUE(term, _system(_mesh("rect", dataset), el.ConstantRegularization(1e-3), False))
    assert float(doubled) == pytest.approx(float(direct), rel=1e-9 if X64 else 1e-4)
    assert abs(float(doubled) - float(single)) > 1e-3 * abs(float(single))


@pytest.mark.precision_independent
def test_sparse_symmetric_checks_its_entries():
    # (the test suite's jaxtyping hook sees the mismatch first: a TypeError)
    with pytest.raises((ValueError, TypeError), match=r"one shape|nnz"):
        el.source.SparseSymmetric(np.arange(3), np.arange(2), np.ones(3), 3)
    # an entry outside the matrix is an error on the host, not a write out of bounds
    from equilens.numba._host_linalg import _check_pattern

    with pytest.raises(ValueError, match="outside"):
        _check_pattern(np.array([0, 3]), np.array([1, 1]), 3)
    with pytest.raises(ValueError, match="outside"):
        _check_pattern(np.array([0, 1]), np.array([-1, 1]), 3)
    _check_pattern(np.array([0, 2]), np.array([2, 2]), 3)


class _MovingPattern(AbstractRegularization):
    # constant regularization plus `bump` on two far corners of the mesh: zero there at
    # bump = 0 with a non-zero derivative (its zeros move; fixed_sparsity stays False)
    coefficient: jax.Array
    bump: jax.Array

    def matrix(self, geometry, signal):
        h, logdet = el.ConstantRegularization(self.coefficient).matrix(geometry, signal)
        n = h.shape[0]
        corner = jnp.zeros((n, n), h.dtype).at[0, n - 1].set(1.0).at[n - 1, 0].set(1.0)
        return h + self.bump * corner, logdet


@pytest.mark.precision_independent
@pytest.mark.parametrize("fixed", [False, True])
def test_sparse_route_inverts_all_of_the_system_only_for_a_moving_pattern(
    dataset, monkeypatch, fixed
):
    # the regularization's fixed_sparsity reaches the host: the whole inverse when its
    # zeros can move and it is differentiated, the selected one otherwise. The derivative
    # in the strength (entries inside the envelope) is the dense route's either way; the
    # bump's (a zero entry at far corners, outside the envelope) only from the whole
    # inverse: a false fixed_sparsity claim misses it, as documented
    # (test_host_system_gradient_outside_the_envelope)
    from equilens.numba import _host_linalg

    seen = []
    real = _host_linalg._inverse

    def spy(u, scale, x_bar, start=None, split=None):
        seen.append(start is None)
        return real(u, scale, x_bar, start, split)

    monkeypatch.setattr(_host_linalg, "_inverse", spy)
    cls = type("_Fixed", (_MovingPattern,), {"fixed_sparsity": True}) if fixed else _MovingPattern
    system = _system(_mesh("rect", dataset), cls(jnp.asarray(2e-3), jnp.asarray(0.0)))

    def d_reg(route):
        term = el.LogEvidence(dataset, route=route)
        grad = eqx.filter_jit(eqx.filter_grad(lambda s, t: t(s)))(system, term)
        return grad.source.regularization

    dense, sparse = d_reg("dense"), d_reg("sparse")
    assert seen == [not fixed]
    tol = 1e-8 if X64 else 2e-2
    assert abs(float(sparse.coefficient - dense.coefficient)) <= tol * abs(float(dense.coefficient))
    if not fixed:
        assert abs(float(sparse.bump - dense.bump)) <= tol * abs(float(dense.bump))


@pytest.mark.x64_only
def test_noise_free_source_on_the_mesh_is_recovered_to_round_off():
    grid = el.Grid((40, 40), pixel_scale=PS)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=PS, truncation=3.0)
    mask = grid.circular_mask(0.95)
    system = _system(el.RectangularMesh((9, 9)), el.ConstantRegularization(1e-14), False)
    noise = np.full(grid.shape, 1e-3)
    blank = el.Imaging(np.zeros(grid.shape), noise, psf, PS, mask=mask)
    blurred, _, _ = _np_mapping(system, blank)
    rng = np.random.default_rng(1)
    truth = rng.uniform(1.0, 5.0, blurred.shape[1])
    data = (blurred @ truth).reshape(grid.shape)
    imaging = el.Imaging(data, noise, psf, PS, mask=mask)
    inv = _invert(el.LogEvidence(imaging, route="dense"), system)
    coverage = np.abs(blurred[np.asarray(mask).reshape(-1)]).sum(0)
    # nodes lit by at least 0.1% of the best-covered node's flux; the others (mesh corners
    # touched by a few traced pixels) are set by the regularization
    seen = coverage > 1e-3 * coverage.max()
    assert seen.sum() > 0.8 * seen.size
    assert rel_err(np.asarray(inv.values)[seen], truth[seen]) < 1e-8
    assert float(np.max(np.abs(inv.residuals))) < 1e-9 * float(np.max(data)) / 1e-3


def test_rectangular_mesh_keeps_its_edge_rays_to_round_off():
    # the outermost traced pixels are the mesh's edges: the same rays traced again by
    # another computation (rendering a completed model) may land an ulp outside and must
    # keep their weights; points clearly outside get none
    x = jnp.asarray([-0.7, 0.1, 0.9])
    y = jnp.asarray([-0.5, 0.3, 0.6])
    geometry = el.RectangularMesh((6, 5)).geometry(_lens(), x, y)
    eps = float(jnp.finfo(x.dtype).eps)
    px = jnp.asarray([0.9 + 2 * eps, -0.7 - 2 * eps, 0.9 + 1e-4, 0.1])
    py = jnp.asarray([0.6 + 2 * eps, -0.5, 0.3, -0.5 - 1e-4])
    _, w = geometry.interpolation(px, py)
    assert np.allclose(np.asarray(w.sum(axis=1)), [1.0, 1.0, 0.0, 0.0])


def test_uniform_rectangular_cells_match_the_searched_ones():
    # a RectangularMesh's geometry finds cells arithmetically (uniform=True): the same
    # interpolated values as the searched cells of the same edges, at nodes, edges,
    # outside points and NaN, and the same gradient with respect to the points and to
    # the bounds the edges are made from
    geometry = el.RectangularMesh((7, 9)).geometry(
        _lens(), jnp.asarray([-0.73, 1.1]), jnp.asarray([-0.41, 0.66])
    )
    assert geometry.uniform
    # a mesh's placeholder (an unsolved source's) has the structure of its solved geometry
    for mesh in (el.RectangularMesh((7, 9)), el.AdaptiveRectangularMesh((7, 9))):
        solved = mesh.geometry(_lens(), jnp.asarray([-0.73, 1.1]), jnp.asarray([-0.41, 0.66]))
        assert jax.tree.structure(mesh.placeholder()) == jax.tree.structure(solved)
    rng = np.random.default_rng(3)
    nodes = geometry.nodes()
    px = jnp.concatenate(
        [jnp.asarray(rng.uniform(-0.8, 1.2, 400)), nodes[:, 0], jnp.asarray([2.0, jnp.nan])]
    )
    py = jnp.concatenate(
        [jnp.asarray(rng.uniform(-0.5, 0.7, 400)), nodes[:, 1], jnp.asarray([0.0, 0.1])]
    )
    values = jnp.asarray(rng.normal(size=geometry.n_pixels))

    def interpolated(g, x, y):
        idx, w = g.interpolation(x, y)
        return jnp.sum(w * values[idx], axis=1)

    searched = dataclasses.replace(geometry, uniform=False)
    fast, slow = interpolated(geometry, px, py), interpolated(searched, px, py)
    finite = np.isfinite(np.asarray(px))
    tol = 1e-13 if X64 else 1e-5
    assert np.allclose(np.asarray(fast)[finite], np.asarray(slow)[finite], rtol=0, atol=tol)
    assert np.allclose(np.asarray(fast)[400:-2], np.asarray(values), atol=tol)
    assert float(fast[-2]) == 0.0

    def chi(x, y, uniform):
        # the mesh's bounds from the points themselves, as in a fit
        g = el.RectangularMesh((7, 9)).geometry(_lens(), x, y)
        g = dataclasses.replace(g, uniform=uniform)
        return jnp.sum(interpolated(g, x, y) ** 2)

    gx, gy = px[:400], py[:400]
    d_chi = jax.jit(jax.grad(chi, argnums=(0, 1)), static_argnums=2)
    d_fast, d_slow = d_chi(gx, gy, True), d_chi(gx, gy, False)
    for f, s in zip(d_fast, d_slow, strict=True):
        assert rel_err(np.asarray(f), np.asarray(s)) < (1e-10 if X64 else 1e-3)


def test_completed_system_renders_the_inverted_model(dataset):
    system = _system(_mesh("rect", dataset), _reg("constant"))
    term = el.LogEvidence(dataset)
    done = eqx.filter_jit(lambda t, s: t.complete(s))(term, system)
    inv = _invert(term, system)
    image = done.image(dataset.grid, dataset.convolution)
    mask = np.asarray(dataset.mask)
    scale = float(np.max(np.abs(np.asarray(inv.model_image)[mask])))
    diff = np.abs(np.asarray(image - inv.model_image))[mask]
    assert diff.max() < (1e-10 if X64 else 1e-4) * scale
    assert float(jnp.abs(done.lens_light.amp - inv.amplitudes[0])) == 0.0


@pytest.mark.x64_only
@pytest.mark.parametrize("options", ["equilens", "pyautolens"])
@pytest.mark.parametrize("mesh", ["rect", "delaunay"])
def test_gradient_matches_finite_differences(dataset, mesh, options):
    if options == "equilens":
        system = _system(_mesh(mesh, dataset), _reg("constant"))
        term = el.LogEvidence(dataset)
    else:
        # (centred nodes with extrapolation; the mask alone; the source block's log det)
        m = el.RectangularMesh((10, 12), nodes="centres") if mesh == "rect" else None
        system = _system(m or _mesh(mesh, dataset), _reg("constant"))
        term = el.LogEvidence(dataset, map_outside_mask=False, marginalise_amplitudes=False)

    def build(p):
        m = eqx.tree_at(
            lambda s: (
                s.mass.components[0].theta_E,
                s.mass.components[0].e1,
                s.mass.components[1].gamma1,
                s.source.regularization.coefficient,
            ),
            system,
            tuple((p[0], p[1], p[2], jnp.exp(p[3]))),
        )
        return term(m)

    p0 = np.array([0.9, 0.08, 0.03, math.log(2e-3)])
    grad = eqx.filter_jit(jax.grad(lambda p: build(p)))(jnp.asarray(p0))
    fd = fd_grad(lambda p: eqx.filter_jit(build)(jnp.asarray(p)), p0, h=1e-6)
    assert rel_err(grad, fd) < 2e-4


@pytest.mark.x64_only
def test_evidence_peaks_at_the_true_einstein_radius_and_slope():
    true = mass.EPL(theta_E=0.9, gamma=2.0, e1=0.05, e2=0.02)
    grid = el.Grid((44, 44), pixel_scale=PS)
    psf = el.GaussianPSF(fwhm=0.11, pixel_scale=PS, truncation=3.0)
    source = light.Sersic(amp=40.0, R_sersic=0.1, n_sersic=1.0, e1=0.15, center_x=0.05)
    imaging = el.simulate(
        jax.random.key(7),
        el.LensSystem(mass=true, source=source),
        grid,
        psf,
        exposure_time=3000.0,
        sky_level=1.0,
        mask=grid.circular_mask(1.05),
    )
    term = el.LogEvidence(imaging)
    mesh = el.AdaptiveRectangularMesh((14, 14))
    evidence = eqx.filter_jit(
        lambda t, m, lam: t.log_evidence(
            el.LensSystem(mass=m, source=el.PixelizedSource(mesh, el.ConstantRegularization(lam)))
        )
    )

    def best(m):  # the evidence at its best regularization strength
        return max(float(evidence(term, m, jnp.asarray(lam))) for lam in 10.0 ** np.arange(-5, 0))

    thetas = [0.84, 0.87, 0.9, 0.93, 0.96]
    ev_theta = [best(eqx.tree_at(lambda m: m.theta_E, true, jnp.asarray(t))) for t in thetas]
    gammas = [1.8, 1.9, 2.0, 2.1, 2.2]
    ev_gamma = [best(eqx.tree_at(lambda m: m.gamma, true, jnp.asarray(g))) for g in gammas]
    assert int(np.argmax(ev_theta)) == 2, ev_theta
    assert int(np.argmax(ev_gamma)) == 2, ev_gamma


@pytest.mark.x64_only
def test_positive_only_solve_matches_scipy_nnls(dataset):
    system = _system(_mesh("rect", dataset), el.ConstantRegularization(1e-4), False)
    term = el.LogEvidence(dataset, nonnegative=True, route="dense")
    inv = _invert(term, system)
    assert float(jnp.min(inv.values)) >= 0.0
    # the same quadratic program solved by scipy: min 0.5 s^T A s - b^T s, s >= 0
    blurred, _, geo = _np_mapping(system, dataset)
    mask = np.asarray(dataset.mask).reshape(-1)
    sigma = np.asarray(dataset.noise_map).reshape(-1)[mask]
    c = blurred[mask] / sigma[:, None]
    a = c.T @ c + _np_regularization(system.source.regularization, geo, None)
    b = c.T @ (np.asarray(dataset.data).reshape(-1)[mask] / sigma)
    chol = np.linalg.cholesky(a)
    ref, _ = scipy.optimize.nnls(chol.T, np.linalg.solve(chol, b), maxiter=10_000)
    assert rel_err(inv.values, ref) < 1e-6
    assert int(np.sum(ref == 0)) > 0  # the constraint is active somewhere


@slow_ci
@pytest.mark.x64_only
def test_positive_only_solve_is_the_same_on_the_sparse_route(dataset):
    # the sparse route factorises on the host (LAPACK): same constrained solution, evidence
    # and gradient as the dense route
    system = _system(_mesh("rect", dataset), el.ConstantRegularization(1e-4), False)
    dense = _invert(el.LogEvidence(dataset, nonnegative=True, route="dense"), system)
    sparse = _invert(el.LogEvidence(dataset, nonnegative=True, route="sparse"), system)
    assert rel_err(sparse.values, dense.values) < 1e-8
    assert abs(float(sparse.log_evidence - dense.log_evidence)) < 1e-8 * abs(
        float(dense.log_evidence)
    )
    grads = [
        eqx.filter_jit(eqx.filter_grad(lambda m, t: t(eqx.tree_at(lambda s: s.mass, system, m))))(
            system.mass, el.LogEvidence(dataset, nonnegative=True, route=route)
        )
        for route in ("dense", "sparse")
    ]
    flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in grads]
    assert rel_err(flat[1], flat[0]) < 1e-7


def test_errors_are_the_inverse_curvature_diagonal(dataset):
    system = _system(_mesh("rect", dataset), _reg("constant"), False)
    inv = _invert(el.LogEvidence(dataset, route="dense"), system, errors=True)
    assert bool(jnp.all(inv.errors > 0))
    if X64:
        blurred, _, geo = _np_mapping(system, dataset)
        mask = np.asarray(dataset.mask).reshape(-1)
        sigma = np.asarray(dataset.noise_map).reshape(-1)[mask]
        c = blurred[mask] / sigma[:, None]
        a = c.T @ c + _np_regularization(system.source.regularization, geo, None)
        assert rel_err(inv.errors, np.sqrt(np.diag(np.linalg.inv(a)))) < 1e-8
    image = inv.source_image(el.Grid((30, 30), pixel_scale=0.03))
    assert image.shape == (30, 30) and bool(jnp.all(jnp.isfinite(image)))


@pytest.mark.precision_independent
def test_mesh_with_more_pixels_than_data_raises(dataset):
    system = _system(el.RectangularMesh((40, 40)), _reg("constant"))
    with pytest.raises(ValueError, match="pixels but the mask only"):
        el.LogEvidence(dataset).invert(system)


@pytest.mark.precision_independent
def test_empty_mask_raises():
    grid = el.Grid((20, 20), pixel_scale=PS)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=PS)
    with pytest.raises(ValueError, match="mask is empty"):
        el.Imaging(
            np.zeros(grid.shape), np.ones(grid.shape), psf, PS, mask=np.zeros((20, 20), bool)
        )
    with pytest.raises(ValueError, match="n_nodes"):
        el.DelaunayMesh.from_mask(grid, np.zeros((20, 20), bool), 10)


def test_singular_system_gives_infinite_term_not_nan(dataset):
    # two identical linear lens-light components: the unregularized block is singular
    same = light.Sersic(amp=1.0, R_sersic=0.5, n_sersic=2.5)
    system = el.LensSystem(
        mass=_lens(),
        lens_light=same + same,
        source=el.PixelizedSource(_mesh("rect", dataset), _reg("constant")),
    )
    for route in ("dense", "sparse"):
        term = el.LogEvidence(dataset, route=route)
        inv = _invert(term, system)
        assert not bool(inv.valid)
        assert float(inv.log_evidence) == -math.inf
        assert bool(jnp.all(jnp.isnan(inv.values)))
        assert float(eqx.filter_jit(lambda t, s: t(s))(term, system)) == math.inf
    # and, on the host solve, a zero gradient, not NaN (which would poison an optimiser's
    # state; lineax's derivative on the other routes raises instead)
    grad = eqx.filter_jit(eqx.filter_grad(lambda s, t: t(s)))(system, term)
    leaves = jax.tree.leaves(eqx.filter(grad, eqx.is_inexact_array))
    assert leaves and all(bool(jnp.all(v == 0.0)) for v in leaves)


@pytest.mark.precision_independent
def test_bad_arguments_raise(dataset):
    with pytest.raises(ValueError, match="route"):
        el.LogEvidence(dataset, route="fast")
    with pytest.raises(ValueError, match="coefficient must be finite and in"):
        el.ConstantRegularization(0.0)
    with pytest.raises(ValueError, match="nu"):
        el.MaternKernel(1.0, 0.1, nu=1.0)
    with pytest.raises(ValueError, match="shape"):
        el.RectangularMesh((1, 5))
    with pytest.raises(TypeError, match="PixelizedSource"):
        el.LogEvidence(dataset).invert(
            el.LensSystem(mass=_lens(), source=light.Sersic(amp=1.0, R_sersic=0.1, n_sersic=1.0))
        )
    with pytest.raises(TypeError, match=r"use equilens\.LogEvidence"):
        el.GaussianLikelihood(dataset).model_image(
            _system(_mesh("rect", dataset), _reg("constant"))
        )
    with pytest.raises(ValueError, match="data resolution"):
        psf2 = el.GaussianPSF(fwhm=0.1, pixel_scale=PS, supersampling=2)
        imaging = el.Imaging(
            np.asarray(dataset.data), np.asarray(dataset.noise_map), psf2, PS, supersampling=2
        )
        el.LogEvidence(imaging)


@pytest.mark.x64_only
def test_supersampled_grid_matches_numpy():
    grid = el.Grid((36, 36), pixel_scale=PS, supersampling=2)
    psf = el.GaussianPSF(fwhm=0.11, pixel_scale=PS, truncation=3.0)
    rng = np.random.default_rng(0)
    data = rng.normal(size=grid.shape) + 5.0
    imaging = el.Imaging(
        data, np.ones(grid.shape), psf, PS, mask=grid.circular_mask(0.8), supersampling=2
    )
    system = _system(el.RectangularMesh((8, 8)), el.ConstantRegularization(0.1), False)
    inv = _invert(el.LogEvidence(imaging), system)
    ref, _ = np_log_evidence(system, imaging)
    assert abs(float(inv.log_evidence) - ref) <= 1e-10 * abs(ref)


def _lens_with_light(mask, deflector=None):
    truth = el.LensSystem(
        mass=deflector or mass.SIE(theta_E=1.0, e1=0.08, e2=-0.03) + mass.ExternalShear(0.02, 0.01),
        lens_light=light.Sersic(amp=4.0, R_sersic=0.6, n_sersic=3.0, e1=0.05),
        source=light.Sersic(amp=15.0, R_sersic=0.15, n_sersic=1.0, e1=0.2, center_x=0.03),
    )
    grid = el.Grid((56, 56), pixel_scale=PS)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=PS, truncation=3.0)
    imaging = el.simulate(
        jax.random.key(1),
        truth,
        grid,
        psf,
        exposure_time=2000.0,
        sky_level=1.0,
        mask=mask(grid),
    )
    return truth, imaging


@pytest.mark.slow
@pytest.mark.x64_only
def test_evidence_fit_recovers_the_mass_and_fills_in_the_source():
    truth, imaging = _lens_with_light(lambda grid: grid.annular_mask(0.3, 1.4))
    start = el.LensSystem(
        mass=mass.SIE(theta_E=0.97, e1=0.05, e2=0.0) + mass.ExternalShear(0.0, 0.0),
        lens_light=light.Sersic(amp=1.0, R_sersic=0.6, n_sersic=3.0, e1=0.05),
        source=el.PixelizedSource(
            el.AdaptiveRectangularMesh((14, 14)), el.ConstantRegularization(1.0)
        ),
    )
    # the images of the source's centre held together (as the CLI does from its parametric
    # stage): the guard stays inside its threshold at the truth's minimum
    pos = el.solve.auto_positions(imaging, truth)
    assert pos is not None and pos.shape[0] >= 2
    result, inversion, stages = el.solve.fit_pixelized(imaging, start, positions=pos, log=None)
    assert all(s["positions_penalty"] == 0.0 for s in stages)
    assert result.term_values.shape == (2,)
    errors = dict(zip(result.names, np.asarray(result.errors), strict=True))
    theta = float(result.model.mass.components[0].theta_E)
    assert abs(theta - 1.0) < max(5 * errors["mass.components[0].theta_E"], 3e-3)
    assert float(result.model.source.regularization.coefficient) != 1.0  # fitted
    assert bool(inversion.valid) and result.success
    assert [s["stage"][:7] for s in stages] == ["stage 1", "stage 2"]
    assert stages[-1]["log_evidence"] == pytest.approx(float(inversion.log_evidence), rel=1e-9)
    assert stages[1]["log_evidence"] >= stages[0]["log_evidence"]
    # each stage records its Einstein radius: stage 1 holds the mass, the last is the result
    assert stages[0]["theta_E"] == pytest.approx(0.97, abs=1e-12)
    assert stages[-1]["theta_E"] == pytest.approx(theta, rel=1e-12)
    # the result holds the solved source: it renders the inversion's model
    image = result.model.image(imaging.grid, imaging.convolution)
    mask = np.asarray(imaging.mask)
    assert rel_err(np.asarray(image)[mask], np.asarray(inversion.model_image)[mask]) < 1e-6


def _light_dataset():
    truth, imaging = _lens_with_light(lambda grid: grid.circular_mask(1.4))
    # the lens light as a fit beside a poor source leaves it: too faint, too round, too small
    wrong = light.Sersic(amp=3.0, R_sersic=0.45, n_sersic=3.0, e1=-0.05)
    start = el.LensSystem(
        mass=truth.mass,
        lens_light=light.FixedLight(wrong),
        source=el.PixelizedSource(
            el.AdaptiveRectangularMesh((14, 14)), el.ConstantRegularization(1.0)
        ),
    )
    return truth, imaging, start


def _light_error(imaging, system, truth):
    # the lens light's image against the truth's, relative, over the mask
    mask = np.asarray(imaging.mask)

    def image(profile):
        dark = light.FixedLight(light.Gaussian(amp=0.0, sigma=PS))
        lens = el.LensSystem(truth.mass, dark, profile)
        return np.asarray(lens.image(imaging.grid, imaging.convolution))[mask]

    want = image(truth.lens_light)
    return np.linalg.norm(image(system.lens_light.profile) - want) / np.linalg.norm(want)


@slow_ci
def test_lens_light_refitted_beside_the_pixelized_source_moves_to_the_truth():
    truth, imaging, start = _light_dataset()
    term = el.LogEvidence(imaging)
    value = eqx.filter_jit(lambda t, m: t(m))
    refitted = el.solve.refit_lens_light(imaging, start, term)
    assert isinstance(refitted.lens_light, light.FixedLight)  # held again
    assert eqx.tree_equal(refitted.mass, start.mass)  # held
    assert eqx.tree_equal(refitted.source, start.source)
    # the source the start's evidence solves has taken part of the missing lens light, so
    # one round goes part of the way (the chain repeats it while the evidence rises)
    before = _light_error(imaging, start, truth)
    after = _light_error(imaging, refitted, truth)
    assert before > 0.4 and after < 0.6 * before
    assert float(value(term, refitted)) < float(value(term, start)) - 100  # evidence up
    again = el.solve.refit_lens_light(imaging, refitted, term)
    assert _light_error(imaging, again, truth) < after
    with pytest.raises(TypeError, match="FixedLight"):
        wrong = eqx.tree_at(lambda s: s.lens_light, start, truth.lens_light)
        el.solve.refit_lens_light(imaging, wrong, term)


@pytest.mark.slow
@pytest.mark.ci
def test_pixelized_chain_keeps_a_lens_light_round_only_when_the_evidence_rises():
    truth, imaging, start = _light_dataset()
    result, inversion, stages = el.solve.fit_pixelized(
        imaging, start, lens_light="fixed", light_rounds=2, log=None
    )
    names = [s["stage"] for s in stages]
    assert names[:2] == ["stage 1 (regularization)", "stage 2 (mass)"]
    assert names[2].startswith("stage 3 (lens light beside the source, round 1")
    assert stages[2]["log_evidence"] > stages[1]["log_evidence"] + 50
    # the kept stage is the last one that raised the evidence (refitted once more from its
    # minimum for its covariance, which may move it by a hair: 1e-8 relative in a fresh
    # environment of 2026-12-01; the stages differ by more than 1)
    kept = max(s["log_evidence"] for s in stages[1:])
    assert float(inversion.log_evidence) == pytest.approx(kept, rel=1e-6)
    assert _light_error(imaging, result.model, truth) < _light_error(imaging, start, truth)
    theta = float(result.model.mass.components[0].theta_E)
    assert theta == pytest.approx(1.0, abs=0.01)
    # the kept stage's covariance (computed once, after the rounds)
    errors = dict(zip(result.names, np.asarray(result.errors), strict=True))
    assert 0 < errors["mass.components[0].theta_E"] < 0.01
    with pytest.raises(ValueError, match="light_rounds"):
        el.solve.fit_pixelized(imaging, start, light_rounds=-1, log=None)


@slow_ci
def test_the_chain_without_its_errors_ends_at_the_same_model():
    """`fit_pixelized(covariance=False)` (`equilens subhalo`'s smooth model: the scan's
    Laplace evidence gives its errors): the same stages, the kept one fitted once more all
    the same, no errors and a note saying so; the model the chain's with its errors to
    round-off (that last fit's program differs: it compiles the Hessian with it)."""
    _, imaging, start = _light_dataset()
    kw = dict(lens_light="fixed", light_rounds=0, rounds=1, fit_strength=False, log=None)
    full, inv_full, stages_full = el.solve.fit_pixelized(imaging, start, **kw)
    bare, inv_bare, stages_bare = el.solve.fit_pixelized(imaging, start, covariance=False, **kw)
    assert [s["log_evidence"] for s in stages_bare] == [s["log_evidence"] for s in stages_full]
    assert np.all(np.isnan(np.asarray(bare.errors))) and bare.result == full.result
    assert "no errors computed (covariance=False)" in bare.notes
    assert np.all(np.isfinite(np.asarray(full.errors))) and "no errors" not in full.message()
    assert bare.names == full.names
    assert rel_err(np.asarray(bare.values), np.asarray(full.values)) < 1e-8
    assert float(inv_bare.log_evidence) == pytest.approx(float(inv_full.log_evidence), rel=1e-10)


@pytest.mark.slow
@pytest.mark.x64_only
def test_adaptive_regularization_rounds_keep_the_adapt_image_of_the_best_round(monkeypatch):
    truth, imaging = _lens_with_light(lambda grid: grid.annular_mask(0.3, 1.4))
    start = el.LensSystem(
        mass=mass.SIE(theta_E=0.98, e1=0.06, e2=-0.02) + mass.ExternalShear(0.0, 0.0),
        lens_light=truth.lens_light,
        source=el.PixelizedSource(
            el.AdaptiveRectangularMesh((14, 14)), el.AdaptiveBrightness(1.0, 1.0, 1.0)
        ),
    )
    # every covariance fails (as on a lens whose evidence is too rough for it even over
    # 4-sigma steps): a round is kept for its evidence all the same, and the errors are
    # computed once, for the kept stage, which then says they failed
    from equilens.solve import _pixelized

    evidence_fit, asked = _pixelized._evidence_fit, []

    def errors_fail(objective, start, free, solver, max_steps, progress, covariance=True):
        asked.append(covariance)
        r = evidence_fit(objective, start, free, solver, max_steps, progress, covariance=False)
        failed = el.solve.RESULTS.covariance_failed
        return eqx.tree_at(lambda r: r.result, r, failed) if covariance and r.success else r

    monkeypatch.setattr(_pixelized, "_evidence_fit", errors_fail)
    result, inversion, stages = el.solve.fit_pixelized(
        imaging, start, rounds=3, max_steps=300, log=None
    )
    assert asked[-1] and not any(asked[:-1])
    assert result.result == el.solve.RESULTS.covariance_failed
    assert np.isnan(np.asarray(result.errors)).all()
    names = [s["stage"] for s in stages]
    assert names[2] == "stage 3 (adapted to the source, round 1)"
    assert len(names) <= 4 and all("adapted" in n for n in names[2:])
    # the data (with the lens light) as adapt image, then the lensed source alone: the
    # first round raises the evidence, and the result is the best stage, with the adapt
    # image it was fitted with (its inversion gives that stage's evidence again)
    assert stages[2]["log_evidence"] > stages[1]["log_evidence"]
    best = max(s["log_evidence"] for s in stages[1:])
    # (the kept stage is run once more from its minimum for its errors: a few steps that
    # can raise its evidence a little, 3e-5 here; another round's adapt image would move
    # it by far more)
    assert best - 1e-9 * abs(best) <= float(inversion.log_evidence) <= best + 1e-8 * abs(best)
    assert float(result.model.mass.components[0].theta_E) == pytest.approx(1.0, abs=0.01)
    # the inversion carries that stage's adapt image: the term built from it gives the
    # result's evidence again (what a scan or sampler of this model must use), the
    # default term (the data, lens light included, as adapt image) another one
    term = el.LogEvidence(imaging, adapt_image=inversion.adapt_image)
    again = float(term.log_evidence(result.model))
    assert again == pytest.approx(float(inversion.log_evidence), rel=1e-10)
    np.testing.assert_array_equal(term.adapt_image, inversion.adapt_image)
    data_term = el.LogEvidence(imaging)
    assert abs(float(data_term.log_evidence(result.model)) - best) > 1.0
    # (the data's adapt image: the data on the mapped pixels, zero elsewhere, clipped at 0)
    on = np.zeros(imaging.grid.shape[0] * imaging.grid.shape[1], bool)
    on[np.asarray(data_term.mapped)] = True
    on = on.reshape(imaging.grid.shape)
    np.testing.assert_array_equal(
        np.asarray(data_term.adapt_image)[on], np.maximum(np.asarray(imaging.data)[on], 0.0)
    )
    assert not np.asarray(data_term.adapt_image)[~on].any()


@pytest.mark.slow
@pytest.mark.x64_only
def test_power_law_stage_is_kept_only_when_the_evidence_asks_for_a_slope():
    annulus = lambda grid: grid.annular_mask(0.3, 1.4)
    shear = mass.ExternalShear(0.02, 0.01)
    steep = mass.EPL(theta_E=1.0, gamma=2.25, e1=0.08, e2=-0.03) + shear
    runs = {}
    for name, deflector in (("steep", steep), ("sie", None)):
        truth, imaging = _lens_with_light(annulus, deflector)
        start = el.LensSystem(
            mass=mass.SIE(theta_E=0.98, e1=0.06, e2=-0.02) + mass.ExternalShear(0.0, 0.0),
            lens_light=light.FixedLight(truth.lens_light),
            source=el.PixelizedSource(
                el.AdaptiveRectangularMesh((14, 14)), el.ConstantRegularization(1.0)
            ),
        )
        runs[name] = el.solve.fit_pixelized(
            imaging, start, light_rounds=0, power_law=True, max_steps=300, log=None
        )
    # a slope of 2.25: the power law is kept, its slope and Einstein radius found
    result, inversion, stages = runs["steep"]
    assert [s["stage"] for s in stages][-1] == "stage 3 (power-law mass)"
    first = result.model.mass.components[0]
    assert isinstance(first, mass.EPL) and result.success
    errors = dict(zip(result.names, np.asarray(result.errors), strict=True))
    assert abs(float(first.gamma) - 2.25) < max(4 * errors["mass.components[0].gamma"], 0.03)
    gain = stages[-1]["log_evidence"] - stages[-2]["log_evidence"]
    assert gain > el.solve.POWER_LAW_GAIN
    assert float(inversion.log_evidence) == pytest.approx(stages[-1]["log_evidence"], rel=1e-6)
    assert stages[-1]["gamma"] == pytest.approx(float(first.gamma), abs=1e-3)
    assert abs(float(first.theta_E) - 1.0) < abs(stages[-2]["theta_E"] - 1.0)
    # an isothermal lens: the stage runs, gains less than the threshold, and is not kept
    result, inversion, stages = runs["sie"]
    assert stages[-1]["stage"] == "stage 3 (power-law mass)"
    assert isinstance(result.model.mass.components[0], mass.SIE)
    assert abs(stages[-1]["gamma"] - 2.0) < 0.05
    assert stages[-1]["log_evidence"] - stages[-2]["log_evidence"] < el.solve.POWER_LAW_GAIN
    assert float(inversion.log_evidence) == pytest.approx(stages[-2]["log_evidence"], rel=1e-9)


@slow_ci
@pytest.mark.x64_only
def test_newton_start_steps_into_the_minimum(dataset):
    truth = el.LensSystem(
        mass=_lens(),
        lens_light=light.Sersic(amp=6.0, R_sersic=0.5, n_sersic=2.5),
        source=light.Sersic(amp=30.0, R_sersic=0.12, n_sersic=1.2, e1=0.1, center_x=0.04),
    )
    objective = el.Objective([el.GaussianLikelihood(dataset)])
    start = eqx.tree_at(
        lambda s: (s.mass.components[0].theta_E, s.mass.components[0].e1),
        truth,
        (jnp.asarray(0.903), jnp.asarray(0.09)),
    )
    free = el.select(start, lambda s: s.mass)
    best = el.fit(objective, start, "lm", free=free, covariance=False)
    value = eqx.filter_jit(lambda o, m: o(m))
    v0, v_min = float(value(objective, start)), float(value(objective, best.model))
    moved, drop = el.solve.newton_start(objective, start, free)
    assert drop == pytest.approx(v0 - float(value(objective, moved)), rel=1e-9)
    # chi2 is nearly quadratic here: one step goes almost all the way down
    assert float(value(objective, moved)) - v_min < 0.01 * (v0 - v_min)
    theta = float(moved.mass.components[0].theta_E)
    assert abs(theta - float(best.model.mass.components[0].theta_E)) < 0.05 * abs(0.903 - theta)
    assert eqx.tree_equal(moved.source, start.source)  # only the free parameters move
    with pytest.raises(ValueError, match="scalar"):
        source = light.MGE(amp=jnp.ones(3), sigma=jnp.array([0.1, 0.3, 1.0]))
        mge = el.LensSystem(mass=_lens(), source=source)
        el.solve.newton_start(objective, mge, el.select(mge, lambda s: s.source.sigma))


def test_as_power_law_is_the_same_deflection_with_a_free_slope():
    sie = mass.SIE(theta_E=1.3, e1=0.12, e2=-0.07, center_x=0.05, center_y=-0.03)
    source = light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0)
    system = el.LensSystem(mass=sie + mass.ExternalShear(0.03, -0.02), source=source)
    power = el.solve.as_power_law(system)
    assert power is not None
    first = power.mass.components[0]
    assert isinstance(first, mass.EPL) and float(first.gamma) == 2.0
    x, y = (jnp.asarray(v) for v in np.meshgrid(np.linspace(-2, 2, 21), np.linspace(-2, 2, 21)))
    tol = 1e-10 if jnp.asarray(1.0).dtype == jnp.float64 else 1e-5
    for a, b in zip(system.mass.deflection(x, y), power.mass.deflection(x, y), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) < tol
    # a bare SIE too; anything else has no power law to free
    assert isinstance(
        el.solve.as_power_law(eqx.tree_at(lambda s: s.mass, system, sie)).mass, mass.EPL
    )
    assert el.solve.as_power_law(power) is None


@pytest.mark.slow
@pytest.mark.x64_only
def test_batched_evidence_fits_run_for_every_mesh_kind():
    truth = mass.SIE(theta_E=1.0, e1=0.08, e2=-0.03)
    grid = el.Grid((40, 40), pixel_scale=PS)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=PS, truncation=3.0)
    source = light.Sersic(amp=15.0, R_sersic=0.15, n_sersic=1.0, e1=0.2, center_x=0.03)
    imaging = el.simulate(
        jax.random.key(1),
        el.LensSystem(mass=truth, source=source),
        grid,
        psf,
        exposure_time=2000.0,
        sky_level=1.0,
        mask=grid.annular_mask(0.4, 0.95),
    )
    objective = el.Objective(el.LogEvidence(imaging))
    meshes = [
        el.AdaptiveRectangularMesh((8, 8)),
        el.DelaunayMesh.from_mask(grid, np.asarray(imaging.mask), 60),
    ]
    for mesh in meshes:
        starts = [
            el.LensSystem(
                mass=mass.SIE(theta_E=t, e1=0.05, e2=0.0),
                source=el.PixelizedSource(mesh, el.ConstantRegularization(1e-3)),
            )
            for t in (0.97, 1.03)
        ]
        free = el.select(starts[0], lambda s: (s.mass.theta_E, s.source.regularization))
        batch = jax.tree.map(lambda *x: jnp.stack(x), *starts)
        result = el.fit_batch(objective, batch, "adam", free=free, max_steps=100)
        theta = np.asarray(result.model.mass.theta_E)
        assert theta.shape == (2,) and np.all(np.isfinite(np.asarray(result.value)))
        assert np.all(np.abs(theta - 1.0) < 0.05), theta  # both starts move to the lens
        if isinstance(mesh, el.AdaptiveRectangularMesh):
            assert np.all(np.abs(theta - 1.0) < 0.01), theta


def _random_tile_inputs(n_s=60, shape=(30, 26), k=4, m=2, geometry=False):
    """Random interpolation arrays and tables of the sparse route on an irregular mask
    (with `geometry`, also the kernel, mask pixels and mapped pixels)."""
    from equilens.numba._sparse_route import sparse_tables

    rng = np.random.default_rng(7)
    ny, nx = shape
    yy, xx = np.mgrid[:ny, :nx]
    mask = (yy - 14.0) ** 2 / 1.3 + (xx - 12.0) ** 2 < 110.0
    pixels = np.flatnonzero(mask)
    mapped = np.flatnonzero(scipy.ndimage.binary_dilation(mask, iterations=3))
    # (values exact in float32: the tables hold the kernel in the session's precision)
    kernel = rng.uniform(0.1, 1.0, (7, 5)).astype(np.float32).astype(np.float64)
    kernel[0, :2] = 0.0  # columns with shorter spans
    tables = sparse_tables(kernel, shape, pixels, mapped, tile=4)
    # (repeated pixels within a row, and entries outside the mesh on both sides)
    idx = rng.integers(0, n_s, (mapped.shape[0], k))
    idx[rng.uniform(size=idx.shape) < 0.1] = -1
    idx[rng.uniform(size=idx.shape) < 0.05] = n_s
    w = rng.uniform(0.0, 1.0, idx.shape)
    values = rng.normal(size=(pixels.shape[0], m))
    inv_sigma = rng.uniform(0.5, 2.0, pixels.shape[0])
    arrays = [
        np.asarray(a)
        for a in (
            idx,
            w,
            values,
            inv_sigma,
            tables.tile_rows,
            tables.input_ptr,
            tables.input_pixel,
            tables.input_offset,
            tables.psf_columns,
            tables.psf_span,
        )
    ]
    if geometry:
        return n_s, arrays, (kernel, pixels, mapped)
    return n_s, arrays


@pytest.mark.precision_independent
@pytest.mark.parametrize("k", [1, 3, 4, 6])
def test_sparse_forward_kernel_matches_a_dense_construction(k):
    # F = C^T C and E = C^T V with C = diag(1 / sigma) B M built densely: B the blur from
    # mapped to mask pixels (out(r) = sum_q kernel(r - q + h) in(q)), M the interpolation
    # (entries outside the mesh dropped, repeated pixels summed), for each number of
    # weights per pixel (the four- and three-weight passes and the general one)
    from equilens.numba._runtime import _kernels

    n_s, arrays, (kernel, pixels, mapped) = _random_tile_inputs(k=k, geometry=True)
    idx, w, values, inv_sigma = arrays[:4]
    nx = 26
    hy, hx = kernel.shape[0] // 2, kernel.shape[1] // 2
    dy = pixels[:, None] // nx - mapped[None, :] // nx + hy
    dx = pixels[:, None] % nx - mapped[None, :] % nx + hx
    inside = (dy >= 0) & (dy < kernel.shape[0]) & (dx >= 0) & (dx < kernel.shape[1])
    blur = np.where(inside, kernel[np.clip(dy, 0, hy * 2), np.clip(dx, 0, hx * 2)], 0.0)
    interp = np.zeros((mapped.shape[0], n_s))
    for i in range(k):
        ok = (idx[:, i] >= 0) & (idx[:, i] < n_s)
        np.add.at(interp, (np.flatnonzero(ok), idx[ok, i]), w[ok, i])
    c = inv_sigma[:, None] * (blur @ interp)
    f, e = _kernels().forward(1, n_s, *arrays)
    assert rel_err(f, c.T @ c) < 1e-13
    assert rel_err(e, c.T @ values) < 1e-13


@pytest.mark.precision_independent
@pytest.mark.parametrize("cap", [None, 1])
def test_sparse_kernels_give_the_same_sums_in_any_number_of_chunks(monkeypatch, cap):
    from equilens.numba._runtime import _kernels

    kernels = _kernels()
    n_s, arrays = _random_tile_inputs()
    if cap is not None:  # the accumulators' memory cap leaves one chunk
        monkeypatch.setattr(kernels, "ACCUMULATOR_BYTES", cap)
    f1, e1 = kernels.forward(1, n_s, *arrays)
    assert np.array_equal(f1, f1.T)
    for n in (2, 3, 7):
        f, e = kernels.forward(n, n_s, *arrays)
        assert rel_err(f, f1) < 1e-13
        assert rel_err(e, e1) < 1e-13
    # a smaller mesh with an odd size in between (the kept accumulators are remade)
    small = (arrays[0] % (n_s - 9), *arrays[1:])
    f_small, _ = kernels.forward(3, n_s - 9, *small)
    assert f_small.shape == (n_s - 9, n_s - 9)

    assert rel_err(f_small, kernels.forward(1, n_s - 9, *small)[0]) < 1e-13
    f, _ = kernels.forward(3, n_s, *arrays)
    assert rel_err(f, f1) < 1e-13
    rng = np.random.default_rng(1)
    f_bar = rng.normal(size=f1.shape)
    e_bar = rng.normal(size=e1.shape)
    w1, v1 = kernels.backward(1, *arrays[:4], f_bar, e_bar, *arrays[4:])
    for n in (2, 5):
        wn, vn = kernels.backward(n, *arrays[:4], f_bar, e_bar, *arrays[4:])
        assert rel_err(wn, w1) < 1e-13
        assert rel_err(vn, v1) < 1e-13


@pytest.mark.precision_independent
def test_sparse_kernels_compile_once_for_writable_and_read_only_inputs():
    # JAX hands the host read-only views of its buffers, NumPy arrays are writable: the
    # parallel kernels take every input read-only, so both reuse one compilation
    from equilens.numba._runtime import _kernels

    kernels = _kernels()
    n_s, arrays = _random_tile_inputs()
    frozen = [a.copy() for a in arrays]
    for a in frozen:
        a.flags.writeable = False
    rng = np.random.default_rng(4)
    f_bar, e_bar = rng.normal(size=(n_s, n_s)), rng.normal(size=(n_s, arrays[2].shape[1]))
    results, counts = [], []
    for ops in (arrays, frozen):
        f, e = kernels.forward(1, n_s, *ops)
        w_bar, v_bar = kernels.backward(1, *ops[:4], f_bar, e_bar, *ops[4:])
        results.append((f, e, w_bar, v_bar))
        counts.append((len(kernels._forward.signatures), len(kernels._backward_inverse.signatures)))
    assert counts[1] == counts[0]
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.x64_only
def test_host_system_envelope_is_narrower_than_the_tiles_structure():
    # a point PSF and one source pixel per mapped pixel: F is diagonal, although the 16
    # pixels of a 4x4 tile share its structure. The host solve factors F + H on F's own
    # envelope widened by a dense H's non-zeros (here the neighbours in pixel order,
    # outside F's envelope): it must give the dense solution and log det
    from equilens.numba._host_linalg import sparse_system_solve
    from equilens.numba._runtime import _kernels
    from equilens.numba._sparse_route import sparse_tables, table_arrays

    rng = np.random.default_rng(11)
    n = 144
    pixels = np.arange(n)
    tables = sparse_tables(np.ones((1, 1)), (12, 12), pixels, pixels, tile=4)
    idx = pixels[:, None]
    w = rng.uniform(0.5, 1.5, (n, 1))
    values = rng.normal(size=(n, 1))
    inv_sigma = rng.uniform(0.5, 2.0, n)
    arrays = [np.asarray(a) for a in (idx, w, values, inv_sigma, *table_arrays(tables))]
    f = np.empty((n, n))
    e, first, nonzero, _ = _kernels().forward_into(1, f, 0, n, *arrays)
    cols = np.arange(n)
    assert np.array_equal(nonzero, cols) and np.any(first < cols)
    np.testing.assert_allclose(np.diagonal(f), (w[:, 0] * inv_sigma) ** 2, rtol=1e-14)
    np.testing.assert_allclose(e[:, 0], w[:, 0] * inv_sigma * values[:, 0], rtol=1e-14)
    assert np.array_equal(np.triu(f, 1), np.zeros((n, n)))
    reg = 0.3 * (2.0 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1))
    x, logdet, fit = sparse_system_solve(
        *(jnp.asarray(v) for v in (idx, w, values, inv_sigma, reg)),
        jnp.zeros((0, 0)),
        jnp.zeros(0),
        tables,
    )
    a = np.diag((w[:, 0] * inv_sigma) ** 2) + reg
    b = w[:, 0] * inv_sigma * values[:, 0]
    s = np.linalg.solve(a, b)
    assert rel_err(np.asarray(x), s) < 1e-12
    assert float(logdet) == pytest.approx(np.linalg.slogdet(a)[1], rel=1e-12)
    # the misfit: chi2 of the model C s (C = diag(w / sigma) here) plus s^T H s
    chi2 = np.sum((values[:, 0] - w[:, 0] * inv_sigma * s) ** 2)
    assert float(fit) == pytest.approx(chi2 + s @ reg @ s, rel=1e-12)


@pytest.mark.precision_independent
@pytest.mark.parametrize("n_threads", [1, 3])
def test_sparse_reverse_pass_from_kept_blocks_matches_rebuilding_them(n_threads):
    # the forward kernel may keep its tile blocks for the reverse pass: the same F, E and
    # structure, and the backward kernel gives the same cotangents from them as from
    # blocks it builds again
    from equilens.numba._runtime import _kernels

    kernels = _kernels()
    n_s, arrays = _random_tile_inputs()
    idx, w, values, inv_sigma, *tables = arrays
    f0, f1 = np.empty((n_s, n_s)), np.empty((n_s, n_s))
    e0, first0, nonzero0, none = kernels.forward_into(n_threads, f0, 0, n_s, *arrays)
    e1, first1, nonzero1, kept = kernels.forward_into(n_threads, f1, 0, n_s, *arrays, keep=True)
    assert all(b.shape[0] == 0 for b in none)
    ptr, members, rows = kept
    assert ptr.shape == (tables[0].shape[0] + 1,) and rows.shape == (ptr[-1], 16)
    for t in range(ptr.shape[0] - 1):  # each tile's source pixels, ascending
        assert np.all(np.diff(members[ptr[t] : ptr[t + 1]]) > 0)
    assert members.min() >= 0 and members.max() < n_s
    assert rel_err(np.triu(f1), np.triu(f0)) < 1e-14 and rel_err(e1, e0) < 1e-14
    assert np.array_equal(first0, first1) and np.array_equal(nonzero0, nonzero1)
    # the envelope: each column's first non-zero row of F's upper triangle (the diagonal
    # for a column without any), inside the structure
    upper = np.triu(f0) != 0.0
    cols = np.arange(n_s)
    assert np.array_equal(nonzero0, np.where(upper.any(axis=0), np.argmax(upper, axis=0), cols))
    assert np.all(nonzero0 >= first0) and np.any(nonzero0 < cols)
    rng = np.random.default_rng(3)
    z = rng.normal(size=(n_s, n_s))
    scale, b_bar, x = rng.uniform(0.5, 2.0, n_s), rng.normal(size=n_s), rng.normal(size=n_s)
    e_bar = rng.normal(size=e0.shape)
    args = (z, scale, b_bar, x, 0.7, 0, n_s, idx, w, values, inv_sigma, e_bar)
    w_kept, v_kept = kernels.backward_inverse(n_threads, *args, *kept, *tables)
    w_new, v_new = kernels.backward_inverse(n_threads, *args, *none, *tables)
    assert rel_err(w_kept, w_new) < 1e-13 and rel_err(v_kept, v_new) < 1e-13
    assert np.count_nonzero(w_kept) > w_kept.size // 2


@pytest.mark.x64_only
@pytest.mark.parametrize("kind", ["moving", "fixed", "entries"])
def test_host_system_gradient_outside_the_envelope(monkeypatch, kind):
    # a mapping with locality (each mapped pixel to the four source pixels around it on a
    # 3x coarser grid) gives a banded system: the far corner (0, n - 1) lies outside its
    # envelope. A regularization entry there that is zero but moves has the cotangent
    # tr((F + H)^-1 dH) only from the whole inverse (a dense H, fixed_sparsity False); the
    # selected inverse, exact on the envelope, misses it (what the flag is for), yet
    # agrees on a derivative that stays inside (the strength). Given by its entries
    # (SparseSymmetric), the corner is in the pattern: the envelope holds it although its
    # value is zero, and the selected inverse is exact there too
    from equilens.numba import _envelope_kernels, _host_linalg
    from equilens.numba._sparse_route import sparse_gram, sparse_tables

    monkeypatch.setattr(_envelope_kernels, "ENVELOPE_BLOCK", 8)
    rng = np.random.default_rng(3)
    ny, nx = 36, 30
    mask = np.zeros((ny, nx), bool)
    mask[3:-3, 3:-3] = True
    pixels = np.flatnonzero(mask)
    mapped = np.flatnonzero(scipy.ndimage.binary_dilation(mask, iterations=3))
    tables = sparse_tables(rng.uniform(0.1, 1.0, (5, 5)), (ny, nx), pixels, mapped, tile=4)
    gy, gx = ny // 3 + 1, nx // 3 + 1
    n_s = gy * gx
    y, x = np.divmod(mapped, nx)
    base = (y // 3) * gx + x // 3
    idx = np.stack([base, base + 1, base + gx, base + gx + 1], axis=1)
    w = rng.uniform(0.1, 1.0, idx.shape)
    light = rng.normal(size=(pixels.shape[0], 1))
    values = np.concatenate([rng.normal(size=(pixels.shape[0], 1)), light], axis=1)
    inv_sigma = rng.uniform(0.5, 2.0, pixels.shape[0])
    lap = np.diag(np.full(n_s, 4.0)) - np.eye(n_s, k=1) - np.eye(n_s, k=-1)
    lap = lap - np.eye(n_s, k=gx) - np.eye(n_s, k=-gx) + 0.1 * np.eye(n_s)
    corner = np.zeros((n_s, n_s))
    corner[0, -1] = corner[-1, 0] = 1.0
    gram = light.T @ light
    rhs = light.T @ values[:, 0]
    args = [jnp.asarray(v) for v in (idx, w, values, inv_sigma)]

    def regularization(p):
        return p[0] * jnp.asarray(lap) + p[1] * jnp.asarray(corner)

    rows, cols = np.nonzero(np.triu(lap))
    rows, cols = np.append(rows, n_s - 1), np.append(cols, 0)  # the corner, reversed

    def entries(p):
        v = jnp.asarray(lap[rows[:-1], cols[:-1]])
        return el.source.SparseSymmetric(rows, cols, jnp.append(p[0] * v, p[1]), n_s)

    # (x, log det and the misfit t^T t - x^T b, each with a cotangent)
    def host(p):
        x, logdet, fit = _host_linalg.sparse_system_solve(
            *args,
            entries(p) if kind == "entries" else regularization(p),
            jnp.asarray(gram),
            jnp.asarray(rhs),
            tables,
            fixed_sparsity=kind == "fixed",
        )
        return jnp.sum(x * jnp.arange(1.0, x.shape[0] + 1)) + logdet + 0.3 * fit

    def dense(p):
        f, e = sparse_gram(*args, n_s, tables)
        a = jnp.block([[jnp.asarray(gram), e[:, 1:].T], [e[:, 1:], f + regularization(p)]])
        b = jnp.concatenate([jnp.asarray(rhs), e[:, 0]])
        x = jnp.linalg.solve(a, b)
        fit = values[:, 0] @ values[:, 0] - x @ b
        return jnp.sum(x * jnp.arange(1.0, x.shape[0] + 1)) + jnp.linalg.slogdet(a)[1] + 0.3 * fit

    p = jnp.asarray([0.5, 0.0])
    v_host, v_dense = float(jax.jit(host)(p)), float(jax.jit(dense)(p))
    assert abs(v_host - v_dense) < 1e-9 * abs(v_dense)
    g_host, g_dense = jax.jit(jax.grad(host))(p), jax.jit(jax.grad(dense))(p)
    assert rel_err(g_host[0], g_dense[0]) < 1e-8
    if kind == "fixed":
        assert abs(float(g_host[1] - g_dense[1])) > 1e-6 * abs(float(g_dense[1]))
    else:
        assert rel_err(g_host[1], g_dense[1]) < 1e-8


@slow_ci
@pytest.mark.x64_only
def test_host_system_cotangents_of_every_operand():
    # the host system's reverse-mode rule in the mapping weights, the data and linear
    # light columns, the linear light's Gram matrix and right-hand side and the
    # regularization, for x, log det a and the misfit t^T t - x^T b each weighted,
    # against JAX's derivative of the same system solved densely
    from equilens.numba import _host_linalg
    from equilens.numba._sparse_route import SparseTables, sparse_gram

    n_s, arrays = _random_tile_inputs(m=3)
    idx, w, values, inv_sigma = (jnp.asarray(a) for a in arrays[:4])
    tables = SparseTables(*(jnp.asarray(a) for a in arrays[4:]))
    rng = np.random.default_rng(2)
    light = values[:, 1:]  # (two linear light columns; a ridge on their amplitudes)
    gram0 = light.T @ light + 0.1 * jnp.eye(2)
    rhs0 = light.T @ values[:, 0]
    chain = 2.05 * np.eye(n_s) - np.eye(n_s, k=1) - np.eye(n_s, k=-1)
    lap = jnp.asarray(chain)
    probe = jnp.asarray(rng.normal(size=n_s + 2))

    def host(w_, v_, gram, rhs, lam):
        x, logdet, fit = _host_linalg.sparse_system_solve(
            idx, w_, v_, inv_sigma, lam * lap, gram, rhs, tables, fixed_sparsity=True
        )
        return probe @ x + 0.5 * logdet + 0.3 * fit

    def dense(w_, v_, gram, rhs, lam):
        f, e = sparse_gram(idx, w_, v_, inv_sigma, n_s, tables)
        a = jnp.block([[gram, e[:, 1:].T], [e[:, 1:], f + lam * lap]])
        b = jnp.concatenate([rhs, e[:, 0]])
        x = jnp.linalg.solve(a, b)
        fit = v_[:, 0] @ v_[:, 0] - x @ b
        return probe @ x + 0.5 * jnp.linalg.slogdet(a)[1] + 0.3 * fit

    ops = (w, values, gram0, rhs0, jnp.asarray(0.7))
    assert float(jax.jit(host)(*ops)) == pytest.approx(float(jax.jit(dense)(*ops)), rel=1e-11)
    g_host = jax.jit(jax.grad(host, argnums=(0, 1, 2, 3, 4)))(*ops)
    g_dense = jax.jit(jax.grad(dense, argnums=(0, 1, 2, 3, 4)))(*ops)
    for a, b in zip(g_host, g_dense, strict=True):
        assert rel_err(a, b) < 1e-9
    # the misfit: chi2 of the model K x (K = [light, C], C^T C = F, C^T light = E1) plus
    # the regularization term (0.7 lap on the source, the ridge on the amplitudes), each
    # term from the solution
    x, _, fit = _host_linalg.sparse_system_solve(
        idx, w, values, inv_sigma, 0.7 * lap, gram0, rhs0, tables
    )
    f, e = sparse_gram(idx, w, values, inv_sigma, n_s, tables)
    amp, src = x[:2], x[2:]
    t = values[:, 0]
    kx_kx = amp @ (light.T @ light) @ amp + 2.0 * amp @ (e[:, 1:].T @ src) + src @ f @ src
    chi2 = t @ t - 2.0 * (amp @ rhs0 + src @ e[:, 0]) + kx_kx
    reg_term = 0.7 * src @ lap @ src + 0.1 * amp @ amp
    assert float(fit) == pytest.approx(float(chi2 + reg_term), rel=1e-10)


@slow_ci  # (20 s: two eager reverse passes of the sparse route)
def test_factor_store_is_only_a_shortcut(dataset, monkeypatch):
    # the sparse route's reverse pass takes the forward call's factor from the host store;
    # without it (dropped, or taken by an earlier pass of the same call) it recomputes it:
    # the same gradient either way, and a second pullback of one forward call still right
    from equilens.numba import _host_linalg

    system = _system(_mesh("rect", dataset), _reg("constant"), lens_light=True)
    params, static = eqx.partition(system, eqx.is_inexact_array)
    term = el.LogEvidence(dataset, route="sparse")

    def loss(p):
        return term(eqx.combine(p, static))

    def flat(tree):
        return jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(tree)])

    value, pullback = jax.vjp(loss, params)
    first = flat(pullback(jnp.ones_like(value))[0])
    assert len(_host_linalg._FACTORS._items) == 0  # taken, not left behind
    second = flat(pullback(jnp.ones_like(value))[0])  # its factor is gone: recomputed
    assert rel_err(second, first) < (1e-12 if X64 else 1e-5)
    monkeypatch.setattr(_host_linalg._FACTORS, "take", lambda key: None)
    third = flat(jax.grad(loss)(params))
    assert rel_err(third, first) < (1e-12 if X64 else 1e-5)
    assert int(jnp.sum(first != 0.0)) >= 5


def _arrays(item):
    """The NumPy arrays inside `item` (nested tuples and lists)."""
    if isinstance(item, np.ndarray):
        return [item]
    if isinstance(item, tuple | list):
        return [a for part in item for a in _arrays(part)]
    return []


@pytest.mark.precision_independent
@pytest.mark.parametrize("wrt", ["everything", "mass"])
def test_factor_store_keeps_no_view_of_xla_buffers(dataset, monkeypatch, wrt):
    # the forward call's operands are read-only views of XLA's buffers, which XLA reuses
    # once the call returns: what the store keeps for the reverse pass (the factor, the
    # tile blocks of C) must own its memory
    from equilens.numba import _host_linalg

    calls, kept = [], []
    solved, keep = _host_linalg._system_solved, _host_linalg._FACTORS.keep

    def spy(*args, **kwargs):
        calls.append(args)
        return solved(*args, **kwargs)

    def keep_spy(item, size):
        kept.append(item)
        return keep(item, size)

    monkeypatch.setattr(_host_linalg, "_system_solved", spy)
    monkeypatch.setattr(_host_linalg._FACTORS, "keep", keep_spy)
    system = _system(_mesh("rect", dataset), _reg("constant"), lens_light=True)
    term = el.LogEvidence(dataset, route="sparse")
    if wrt == "mass":  # the pixels' weights and values still move: the blocks are kept
        loss = jax.jit(lambda m: term(eqx.tree_at(lambda s: s.mass, system, m)))
        grad = jax.grad(loss)(system.mass)
    else:
        params, static = eqx.partition(system, eqx.is_inexact_array)
        grad = jax.jit(jax.grad(lambda p: term(eqx.combine(p, static))))(params).mass
    assert np.isfinite(float(grad.components[0].theta_E))
    operands = [a for args in calls for a in _arrays(args)]
    arrays = [a for item in kept for a in _arrays(item)]
    assert calls and arrays and operands
    assert any(not a.flags.writeable for a in operands)  # (they are XLA's buffers)
    for a in arrays:
        assert not any(np.shares_memory(a, op) for op in operands)


@pytest.mark.precision_independent
def test_evidence_from_several_threads_is_the_single_thread_evidence(dataset):
    # the host route (Numba kernels, the factor store, the triangulation cache: a Delaunay
    # mesh on the sparse route has them all) called from four Python threads at once, each
    # model twice: its value and gradient as when alone, to the last bit
    term = el.LogEvidence(dataset, route="sparse")
    system = _system(_mesh("delaunay", dataset), _reg("constant"), lens_light=True)
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda s: term(s)))
    models = [
        # (theta_E as an array: a Python float is static under filter_jit, one compilation each)
        eqx.tree_at(lambda s: s.mass.components[0].theta_E, system, jnp.asarray(0.9 + 0.01 * k))
        for k in range(4)
    ]

    def flat(out):
        value, grad = out
        leaves = jax.tree.leaves(eqx.filter(grad, eqx.is_inexact_array))
        return np.concatenate([[float(value)], *(np.ravel(np.asarray(g)) for g in leaves)])

    alone = [flat(value_and_grad(m)) for m in models]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda m: flat(value_and_grad(m)), models * 2))
    for k, got in enumerate(together):
        np.testing.assert_array_equal(got, alone[k % len(models)])
    assert len({a[0] for a in alone}) == len(models)  # (four different models)


@pytest.mark.precision_independent
def test_factor_store_keeps_the_newest_within_its_memory():
    from equilens.numba._host_linalg import _FactorStore

    store = _FactorStore(max_bytes=3 * 800)
    factors = [np.full((10, 10), float(i)) for i in range(5)]
    keys = [store.keep(("solved", i), f.nbytes) for i, f in enumerate(factors)]
    assert len(set(keys)) == 5
    assert [store.take(k) for k in keys] == [
        None,
        None,
        ("solved", 2),
        ("solved", 3),
        ("solved", 4),
    ]
    assert store.take(keys[4]) is None
    # one factor larger than the budget is still kept (until the next arrives)
    big = store.keep(("big",), np.zeros((20, 20)).nbytes)
    assert store.take(big) == ("big",)


@slow_ci
@pytest.mark.precision_independent
def test_sparse_kernels_run_with_single_threaded_blas(dataset, monkeypatch):
    # BLAS's own threads inside Numba's parallel loops oversubscribe the cores
    import threadpoolctl

    from equilens.numba._runtime import _kernels

    kernels = _kernels()
    seen = {}

    def spy(name):
        kernel = getattr(kernels, name)

        def wrapped(*args, **kwargs):
            info = threadpoolctl.threadpool_info()
            seen.setdefault(name, []).extend(
                i["num_threads"] for i in info if i["user_api"] == "blas"
            )
            return kernel(*args, **kwargs)

        return wrapped

    for name in ("forward_into", "backward_inverse"):
        monkeypatch.setattr(kernels, name, spy(name))
    system = _system(_mesh("rect", dataset), _reg("constant"))
    term = el.LogEvidence(dataset, route="sparse")
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        # (eager, so that the kernels run on this thread: OpenBLAS ignores a limit set on
        # another thread while this one holds its own)
        grad = eqx.filter_grad(lambda s: term(s))(system)  # the forward and backward kernels
    assert np.isfinite(float(grad.mass.components[0].theta_E))
    assert set(seen) == {"forward_into", "backward_inverse"}
    assert all(n == 1 for ns in seen.values() for n in ns), seen


@pytest.mark.precision_independent
def test_triangulation_follows_the_nodes_through_the_host_cache():
    # the host keeps recent triangulations by their nodes' bytes (the triangulation and
    # the point location of one model share one): moved nodes must get their own
    from equilens.source._geometry import TriangulationGeometry

    rng = np.random.default_rng(3)
    first = rng.uniform(-1.0, 1.0, size=(40, 2))
    second = first.copy()
    second[:5] = rng.uniform(-1.0, 1.0, size=(5, 2))

    @jax.jit
    def edges_and_cells(nodes):
        geo = TriangulationGeometry.triangulate(nodes)
        idx, _ = geo.interpolation(jnp.asarray([0.1, -0.2]), jnp.asarray([0.05, 0.3]))
        return geo.edges, geo.edge_weight, idx

    for nodes in (first, second, first):
        edges, weight, idx = edges_and_cells(jnp.asarray(nodes))
        tri = Delaunay(nodes)
        want = {
            tuple(sorted(int(v) for v in s[[a, b]]))
            for s in tri.simplices
            for a, b in ((0, 1), (1, 2), (2, 0))
        }
        pairs = zip(np.asarray(edges), np.asarray(weight), strict=True)
        got = {tuple(int(v) for v in e) for e, k in pairs if k}
        assert got == want
        cells = tri.simplices[tri.find_simplex(np.array([[0.1, 0.05], [-0.2, 0.3]]))]
        np.testing.assert_array_equal(np.sort(np.asarray(idx), axis=1), np.sort(cells, axis=1))


@pytest.mark.precision_independent
def test_kept_triangulation_owns_its_nodes():
    # a host callback's operands are views of JAX buffers, reused once the call returns; a
    # triangulation kept for the next call must not read them then (scipy's keeps a
    # reference to its input and computes the point location's transform from it lazily)
    from equilens.source import _geometry

    rng = np.random.default_rng(5)
    nodes = rng.normal(size=(60, 2))
    q = rng.normal(scale=0.5, size=(200, 2))
    tri = Delaunay(nodes)
    simplex = tri.find_simplex(q)
    inside = simplex >= 0
    assert inside.sum() > 100
    operand = nodes.copy()
    _geometry.triangulate_host(operand)  # keeps its triangulation for the point location
    operand[:] = rng.normal(size=operand.shape)  # the operand's buffer, reused
    verts, ok = _geometry.locate_host(nodes, q[:, 0], q[:, 1])  # takes the kept one
    assert int(ok) == 1
    np.testing.assert_array_equal(
        np.sort(verts[inside], axis=1), np.sort(tri.simplices[simplex[inside]], axis=1)
    )


@pytest.mark.slow  # 40 s
@pytest.mark.x64_only
def test_conditional_covariance_when_a_hyperparameter_is_unconstrained(dataset):
    # a zero adapt image: every source pixel's signal is 0, so AdaptiveBrightness weights
    # (without a floor: PyAutoLens's formula)
    # every pixel with the outer coefficient and the inner one has no effect at all
    term = el.LogEvidence(dataset, adapt_image=np.zeros(dataset.shape))
    objective = el.Objective(term)
    system = _system(
        el.RectangularMesh((10, 10)), el.AdaptiveBrightness(1.0, 1.0, 1.0, signal_floor=0.0), False
    )
    free = el.select(system, lambda s: (s.mass.components[0].theta_E, s.source.regularization))
    from equilens.solve._covariance import _covariance_jit
    from equilens.solve._parametrise import parametrisation

    # the gradient is finite (the normalisation of an all-zero signal once gave NaN) and
    # exactly zero for the inner coefficient
    g = eqx.filter_jit(eqx.filter_grad(lambda m: term(m)))(system)
    assert np.isfinite(float(g.mass.components[0].theta_E))
    assert float(g.source.regularization.inner_coefficient) == 0.0
    # the premise: the Hessian over every fitted parameter is singular ...
    param = parametrisation(objective, system, free, None)
    _, ok = _covariance_jit(objective, param, system)
    assert not bool(ok)
    # ... so a fit converged there reports covariance_failed, with no errors
    n = len(param.paths(system))
    value = eqx.filter_jit(term)(system)
    failed = el.solve.FitResult(
        model=system,
        value=value,
        term_values=value[None],
        chi2=jnp.zeros(()),
        num_steps=jnp.zeros((), int),
        result=el.solve.RESULTS.covariance_failed,
        covariance=jnp.full((n, n), jnp.nan),
        names=param.paths(system),
        n_data=objective.n_data,
        n_linear=0,
        solver="bfgs",
    )
    mass_only = el.select(system, lambda s: s.mass.components[0].theta_E)
    out = el.solve.with_conditional_covariance(failed, objective, mass_only)
    assert out.success
    errors = dict(zip(out.names, np.asarray(out.errors), strict=True))
    te = errors.pop("mass.components[0].theta_E")
    assert np.isfinite(te) and te > 0
    # the restricted Hessian's inverse: 1 / d2(-log evidence)/d theta_E^2 at the model
    hess = jax.jit(
        jax.hessian(lambda t: term(eqx.tree_at(lambda s: s.mass.components[0].theta_E, system, t)))
    )(system.mass.components[0].theta_E)
    assert te == pytest.approx(float(hess) ** -0.5, rel=1e-6)
    assert all(np.isnan(v) for v in errors.values())  # the held hyperparameters
    assert "held at their fitted values" in out.message()
    # a result that did not fail for its covariance is left as it is
    done = dataclasses.replace(failed, result=el.solve.RESULTS.successful)
    assert el.solve.with_conditional_covariance(done, objective, mass_only) is done
    with pytest.raises(ValueError, match="fitted parameters only"):
        el.solve.with_conditional_covariance(
            failed, objective, el.select(system, lambda s: s.mass.components[0].e1)
        )


@pytest.mark.x64_only
def test_the_shared_inversion_formulas_give_one_answer_in_numpy_and_jax():
    # (equilens.inversion._formulas: written once for both backends)
    import scipy.linalg

    inv = el.inversion
    rng = np.random.default_rng(3)
    m = rng.normal(size=(40, 12))
    a = m.T @ m  # (40 rows for 12 unknowns: well conditioned)
    b = m.T @ rng.normal(size=40)
    constrained = np.arange(12) >= 2

    def fori(n, body, init):
        return jax.lax.fori_loop(0, n, body, init)

    a_np, b_np, s_np = inv.jacobi_scaling(np, a, b)
    a_j, b_j, s_j = inv.jacobi_scaling(jnp, jnp.asarray(a), jnp.asarray(b))
    assert rel_err(a_j, a_np) < 1e-14 and rel_err(s_j, s_np) < 1e-14
    x_np = inv.projected_gradient(np, a_np, b_np, constrained, inv.python_loop)
    x_j = inv.projected_gradient(jnp, a_j, b_j, jnp.asarray(constrained), fori)
    assert rel_err(x_j, x_np) < 1e-10
    # the minimiser of 0.5 x^T a x - b^T x with x >= 0 where constrained (as a bounded
    # least-squares problem in a's Cholesky factor)
    low = np.linalg.cholesky(a_np)
    lower = np.where(constrained, 0.0, -np.inf)
    exact = scipy.optimize.lsq_linear(
        low.T,
        scipy.linalg.solve_triangular(low, b_np, lower=True),
        bounds=(lower, np.inf),
        tol=1e-14,
    ).x
    assert np.any(exact[constrained] < 1e-12) and np.any(exact[constrained] > 1e-3)
    assert np.array_equal(x_np > 1e-9, exact > 1e-9)
    assert np.max(np.abs(x_np - exact)) < 1e-6

    total = np.array([0.0, 2.0, 6.0, 1.0])
    cover = np.array([0.0, 1.0, 2.0, 0.5])
    expected = np.array([0.0, 2.0 / 3.0, 1.0, 2.0 / 3.0])
    assert np.allclose(inv.source_signal(np, total, cover), expected, rtol=1e-15)
    assert rel_err(inv.source_signal(jnp, jnp.asarray(total), jnp.asarray(cover)), expected) < 1e-15
    assert np.all(inv.source_signal(np, np.zeros(4), cover) == 0.0)
    noise = np.array([0.5, 2.0])
    assert inv.noise_normalisation(np, noise) == pytest.approx(
        np.sum(np.log(2 * np.pi * noise**2)), rel=1e-14
    )
    assert float(inv.log_evidence(10.0, 3.0, 1.0, 4.0)) == -8.0
