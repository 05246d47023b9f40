"""Imaging likelihoods (Gaussian and Poisson) and the linear amplitude solve."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Scalar

from .._lens_system import LensSystem
from ..data import Imaging
from ..inversion._formulas import jacobi_scaling
from ..source import PixelizedSource
from ._base import AbstractDataTerm, AbstractLeastSquaresTerm
from ._formulas import gaussian_normalisation, poisson_deviance


def _used_pixels(imaging: Imaging) -> Int[Array, " n"]:
    return jnp.asarray(np.flatnonzero(np.asarray(imaging.mask)))


def _solve_on(
    g: Float[Array, "k k"], h: Float[Array, " k"], on: Bool[Array, " k"]
) -> Float[Array, " k"]:
    """The least-squares solution with the amplitudes outside `on` held at zero."""
    both = on[:, None] & on[None, :]
    gp = jnp.where(both, g, jnp.eye(g.shape[0], dtype=g.dtype))
    x = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(gp), jnp.where(on, h, 0.0))
    return jnp.where(on, x, 0.0)


def _nnls(g: Float[Array, "k k"], h: Float[Array, " k"]) -> Float[Array, " k"]:
    """argmin 0.5 x^T G x - h^T x subject to x >= 0, for G positive definite with unit
    diagonal (Jacobi-scaled normal equations): the Lawson-Hanson active-set method, which
    ends in finitely many steps at the exact solution (first-order methods such as
    coordinate descent crawl on the nearly degenerate Gram matrix of a multi-Gaussian
    lens light, and stopped early they pick a wrong active set, on which the exact
    re-solve goes negative). At most 3k outer steps, as SciPy's `nnls`."""
    k = h.shape[0]
    tol = 10 * jnp.finfo(g.dtype).eps * k * (1.0 + jnp.max(jnp.abs(h)))
    max_iter = 3 * k

    def gradient(x):
        return h - g @ x

    def outer_cond(state):
        x, on, it = state
        return (it < max_iter) & jnp.any(~on & (gradient(x) > tol))

    def outer(state):
        x, on, it = state
        w = jnp.where(on, -jnp.inf, gradient(x))
        on = on.at[jnp.argmax(w)].set(True)

        def inner_cond(inner):
            _, s, on, it = inner
            return (it < max_iter) & jnp.any(on & (s <= 0))

        def inner(inner):
            # step from x towards s until the first amplitude reaches zero; drop it
            x, s, on, it = inner
            blocking = on & (s <= 0)
            denom = jnp.where(blocking, x - s, 1.0)
            ratio = jnp.where(blocking & (denom > 0), x / denom, jnp.inf)
            alpha = jnp.clip(jnp.min(ratio), 0.0, 1.0)
            x = x + alpha * (s - x)
            on = on & (x > tol)
            x = jnp.where(on, x, 0.0)
            return x, _solve_on(g, h, on), on, it + 1

        x, s, on, it = jax.lax.while_loop(inner_cond, inner, (x, _solve_on(g, h, on), on, it))
        return s, on, it + 1

    start = (jnp.zeros_like(h), jnp.zeros(k, dtype=bool), jnp.asarray(0))
    x, _, _ = jax.lax.while_loop(outer_cond, outer, start)
    return x


def solve_amplitudes(
    system: LensSystem,
    imaging: Imaging,
    *,
    nonnegative: bool = False,
    pixels: Int[Array, " n"] | None = None,
) -> tuple[LensSystem, Float[Array, "ny nx"]]:
    """Fills in the amplitudes of every linear light component of `system` by weighted
    least squares against `imaging` (weights `1/noise^2` on the mask), given all other
    parameters; returns the updated system and its model image.

    The normal equations are Jacobi-scaled and solved by Cholesky; with `nonnegative=True`
    the amplitudes are constrained to be `>= 0` (the Lawson-Hanson active-set method
    finds the exact solution; its free amplitudes are re-solved with gradients, which are
    those of the solution on its active set). Differentiable with respect to the
    non-linear parameters. A degenerate basis (e.g. a source mapped entirely
    outside the mask) gives non-finite amplitudes, which fits report as a failure.
    `pixels` (flat indices of the mask's pixels) is computed from `imaging.mask` when not
    given (pass it when `imaging` is traced, as the imaging terms do).
    """
    blocks, fixed = system.linear_image_blocks(imaging.grid, imaging.convolution)
    if not blocks:
        raise ValueError("the lens system has no linear light component")
    idx = _used_pixels(imaging) if pixels is None else pixels
    w = 1.0 / imaging.noise_map.reshape(-1)[idx]
    target = imaging.data if fixed is None else imaging.data - fixed
    b = target.reshape(-1)[idx] * w
    # the normal equations block by block (one block per field): with the lens light held,
    # a derivative's tangents stay out of its twenty images, and its products with them
    # are formed once rather than once per tangent
    a = [blk.reshape(blk.shape[0], -1)[:, idx] * w[None, :] for blk in blocks]
    g = jnp.block([[ai @ aj.T for aj in a] for ai in a])
    h = jnp.concatenate([ai @ b for ai in a])
    g, h, scale = jacobi_scaling(jnp, g, h, degenerate=0.0)
    # A few-by-few positive-definite system: Cholesky via jax.scipy rather than lineax, whose
    # tangent solves always raise on a singular matrix; here a degenerate basis must become
    # a non-finite objective that the solver's step control rejects, not an exception.
    if nonnegative:
        # the active set is found without gradients; the exact solve on it carries them
        active = jax.lax.stop_gradient(_nnls(g, h)) > 0
        x = _solve_on(g, h, active)
    else:
        x = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(g), h)
    amps = x * scale
    image, start = jnp.zeros(imaging.shape, amps.dtype), 0
    for blk in blocks:
        image = image + jnp.tensordot(amps[start : start + blk.shape[0]], blk, axes=1)
        start += blk.shape[0]
    if fixed is not None:
        image = image + fixed
    return system.with_amplitudes(amps), image


class AbstractImagingTerm(AbstractDataTerm):
    """A likelihood of an `Imaging` dataset given a `LensSystem` model.

    `model_image(system)` is the model the likelihood compares with the data; with
    `linear=True` the amplitudes of the linear light components are first solved by
    weighted least squares (`solve_amplitudes`), so a fit does not vary them.
    """

    imaging: eqx.AbstractVar[Imaging]
    linear: eqx.AbstractVar[bool]
    nonnegative: eqx.AbstractVar[bool]
    pixels: eqx.AbstractVar[Int[Array, " n"]]

    @abc.abstractmethod
    def model_image(self, system: LensSystem) -> Float[Array, "ny nx"]:
        """The model image (flux per pixel) of `system` the likelihood compares with the
        data (with any linearly solved part solved)."""

    @abc.abstractmethod
    def complete(self, system: LensSystem) -> LensSystem:
        """`system` with what the term solves linearly filled in."""

    @property
    def n_data(self) -> int:
        """Number of pixels in the mask."""
        return int(self.pixels.shape[0])

    @property
    def solves_linear(self) -> bool:
        """`linear`: whether the term solves the linear amplitudes (a pixelized source)."""
        return self.linear

    @abc.abstractmethod
    def chi2(self, system: LensSystem) -> Scalar:
        """Sum over the mask of the squared normalised residuals `((d - m) / noise)^2`."""


class AbstractParametricImagingTerm(AbstractImagingTerm):
    """An imaging term whose model is `LensSystem.image`, with the amplitudes of linear
    light components solved by `solve_amplitudes` when `linear`."""

    def model_image(self, system: LensSystem) -> Float[Array, "ny nx"]:
        """The model image (flux per pixel) of `system`, amplitudes solved if `linear`.
        Raises `TypeError` for a pixelized source (solved by `equilens.LogEvidence`)."""
        if isinstance(system.source, PixelizedSource):
            raise TypeError(
                f"{type(self).__name__} cannot solve a PixelizedSource: use equilens.LogEvidence"
            )
        if self.linear:
            return solve_amplitudes(
                system, self.imaging, nonnegative=self.nonnegative, pixels=self.pixels
            )[1]
        return system.image(self.imaging.grid, self.imaging.convolution)

    def complete(self, system: LensSystem) -> LensSystem:
        """`system` with its linear amplitudes solved (unchanged when not `linear`)."""
        if self.linear:
            return solve_amplitudes(
                system, self.imaging, nonnegative=self.nonnegative, pixels=self.pixels
            )[0]
        return system


class GaussianLikelihood(AbstractParametricImagingTerm, AbstractLeastSquaresTerm):
    """Gaussian likelihood of the pixels in the mask:

        -log L = 0.5 sum ((d - m) / noise)^2 + 0.5 sum log(2 pi noise^2),

    with `m` the `LensSystem` model image (PSF-convolved, flux per pixel) on the dataset's
    grid. Residuals are `(d - m) / noise` on the mask, flattened (row-major).

    **Arguments:** `imaging` (an `Imaging` dataset); `linear` (default True: solve the
    amplitudes of linear light components instead of fitting them); `nonnegative` (default
    False: constrain solved amplitudes to be `>= 0`).
    """

    imaging: Imaging
    linear: bool = eqx.field(static=True)
    nonnegative: bool = eqx.field(static=True)
    pixels: Int[Array, " n"]

    def __init__(self, imaging: Imaging, *, linear: bool = True, nonnegative: bool = False):
        if not isinstance(imaging, Imaging):
            raise TypeError(f"GaussianLikelihood needs an Imaging dataset, got {type(imaging)}")
        if nonnegative and not linear:
            raise ValueError("nonnegative=True constrains the linear solve: it needs linear=True")
        self.imaging = imaging
        self.linear = linear
        self.nonnegative = nonnegative
        self.pixels = _used_pixels(imaging)

    def residuals(self, model: LensSystem) -> Float[Array, " n"]:
        diff = (self.imaging.data - self.model_image(model)) / self.imaging.noise_map
        return diff.reshape(-1)[self.pixels]

    def constant(self) -> Scalar:
        noise = self.imaging.noise_map.reshape(-1)[self.pixels]
        return gaussian_normalisation(jnp.sum(jnp.log(noise)), self.pixels.shape[0])

    def chi2(self, system: LensSystem) -> Scalar:
        r = self.residuals(system)
        return jnp.sum(r * r)


class PoissonLikelihood(AbstractParametricImagingTerm):
    """Poisson likelihood of the counts in the mask:

        -log L = sum [lam - c log lam + log Gamma(c + 1)],
        c = (d + background) t,  lam = (m + background) t,

    for data `d` and model `m` in flux per pixel (e.g. electrons/s), `exposure_time` `t`
    (s) and `background` the flux per pixel subtracted from the data (e.g. the sky, `sky
    level x pixel area` for data made by `simulate`). The amplitudes are fitted (a linear
    solve assumes Gaussian noise). `lam` is floored at a tiny positive value.
    """

    imaging: Imaging
    exposure_time: Float[Array, ""]
    background: Float[Array, ""]
    linear: bool = eqx.field(static=True)
    nonnegative: bool = eqx.field(static=True)
    pixels: Int[Array, " n"]

    def __init__(self, imaging: Imaging, exposure_time: float, background: float = 0.0):
        if not float(exposure_time) > 0:
            raise ValueError(f"exposure_time must be > 0 s, got {exposure_time}")
        counts = (np.asarray(imaging.data) + float(background)) * float(exposure_time)
        used = np.asarray(imaging.mask)
        if np.any(counts[used] < -0.5):
            raise ValueError(
                "PoissonLikelihood needs non-negative counts (data + background) x "
                "exposure_time inside the mask; pass the subtracted sky as `background`"
            )
        self.imaging = imaging
        dtype = imaging.data.dtype
        self.exposure_time = jnp.asarray(exposure_time, dtype=dtype)
        self.background = jnp.asarray(background, dtype=dtype)
        self.linear = False
        self.nonnegative = False
        self.pixels = _used_pixels(imaging)

    def __call__(self, model: LensSystem) -> Scalar:
        m = self.model_image(model).reshape(-1)[self.pixels]
        d = self.imaging.data.reshape(-1)[self.pixels]
        gammaln = jax.scipy.special.gammaln
        return poisson_deviance(jnp, m, d, self.background, self.exposure_time, gammaln)

    def chi2(self, system: LensSystem) -> Scalar:
        m = self.model_image(system)
        r = ((self.imaging.data - m) / self.imaging.noise_map).reshape(-1)[self.pixels]
        return jnp.sum(r * r)
