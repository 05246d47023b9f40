"""Multiple-image positions: all images of one source point map to one source position."""

from typing import Literal

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Scalar

from .._custom_types import as_float
from .._lens_system import LensSystem
from .._multiband import MultiBandLensSystem
from ..lensing import solve_lens_equation
from ..mass import AbstractMassProfile
from ._base import AbstractLeastSquaresTerm
from ._formulas import gaussian_normalisation, threshold_excess


def _vector(x: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
    return as_float(x)


def source_plane_offsets(bx, by, fxx, fxy, fyx, fyy):
    """The image-plane offsets `A_i^-1 (beta_i - beta)` of traced images `(bx, by)` from
    the best common source position `beta` (the `A^-T A^-1`-weighted mean: Oguri 2010),
    and `beta`, from the deflection's Jacobians at the images (`hessian`'s four
    components: `fxy = d alpha_x / dy`, `fyx = d alpha_y / dx`, unequal for a multi-plane
    lens). Arithmetic and `.sum()` only, so that JAX and NumPy arrays (the Numba backend)
    run the same formula."""
    # A = d beta / d theta = I - d alpha / d theta; its inverse maps source-plane offsets
    # to the image plane
    a11, a12, a21, a22 = 1 - fxx, -fxy, -fyx, 1 - fyy
    det = a11 * a22 - a12 * a21
    i11, i12, i21, i22 = a22 / det, -a12 / det, -a21 / det, a11 / det
    # M = A^-T A^-1 (symmetric): weights of the best common source position
    m11 = i11 * i11 + i21 * i21
    m12 = i11 * i12 + i21 * i22
    m22 = i12 * i12 + i22 * i22
    s11, s12, s22 = m11.sum(), m12.sum(), m22.sum()
    t1 = (m11 * bx + m12 * by).sum()
    t2 = (m12 * bx + m22 * by).sum()
    sdet = s11 * s22 - s12 * s12
    beta_x = (s22 * t1 - s12 * t2) / sdet
    beta_y = (s11 * t2 - s12 * t1) / sdet
    dx, dy = bx - beta_x, by - beta_y
    return (i11 * dx + i12 * dy, i21 * dx + i22 * dy), (beta_x, beta_y)


class PositionsTerm(AbstractLeastSquaresTerm):
    """Observed positions `(x, y)` (arcsec) of the multiple images of one source point, with
    1-sigma astrometric error `sigma` (arcsec, image plane), must trace back to one source
    position.

    `plane="source"` (default, cheap): each image's source-plane offset from the best
    common source position is mapped back to the image plane through the inverse lens
    Jacobian, `r_i = A_i^-1 (beta_i - beta) / sigma`, with `beta` the weighted mean that
    minimises `sum |r_i|^2` (Oguri 2010's magnification-weighted source-plane chi2).
    `plane="image"`: the lens equation is solved for the image of `beta` nearest each
    observed image (Newton, optimistix), and `r_i = (theta_i' - theta_i) / sigma` (infinite
    where the solve does not converge).

    `model` is a `LensSystem` or a mass profile.
    """

    x: Float[Array, " n_images"] = eqx.field(converter=_vector)
    y: Float[Array, " n_images"] = eqx.field(converter=_vector)
    sigma: Float[Array, ""] = eqx.field(converter=as_float)
    plane: Literal["source", "image"] = eqx.field(static=True, default="source")

    def __check_init__(self):
        if self.x.ndim != 1 or self.x.shape != self.y.shape or self.x.shape[0] < 2:
            raise ValueError(
                f"PositionsTerm needs x and y of the same length >= 2, got shapes "
                f"{self.x.shape} and {self.y.shape}"
            )
        if self.plane not in ("source", "image"):
            raise ValueError(f"PositionsTerm.plane must be 'source' or 'image', got {self.plane!r}")

    def residuals(
        self, model: LensSystem | MultiBandLensSystem | AbstractMassProfile
    ) -> Float[Array, " n"]:
        mass = model.mass if isinstance(model, LensSystem | MultiBandLensSystem) else model
        bx, by = mass.ray_shoot(self.x, self.y)
        fxx, fxy, fyx, fyy = mass.hessian(self.x, self.y)
        (rx, ry), (beta_x, beta_y) = source_plane_offsets(bx, by, fxx, fxy, fyx, fyy)
        if self.plane != "source":
            tx, ty, ok = solve_lens_equation(mass, self.x, self.y, beta_x, beta_y)
            # an image the Newton solve cannot reach gives an infinite residual (a step
            # the fit rejects), never a silently wrong one
            rx = jnp.where(ok, tx, jnp.inf) - self.x
            ry = jnp.where(ok, ty, jnp.inf) - self.y
        return jnp.concatenate([rx, ry]) / self.sigma

    def constant(self) -> Scalar:
        n = 2 * self.x.shape[0]
        return gaussian_normalisation(n * jnp.log(self.sigma), n)


class PositionsThreshold(AbstractLeastSquaresTerm):
    """A penalty that keeps the multiple images of one source point together in the source
    plane, without pulling the model inside a tolerance: zero while every image `(x, y)`
    (arcsec) traces to within `threshold` (arcsec, source plane) of the images' mean
    source position, and `0.5 ((d - threshold) / sigma)^2` summed over the images whose
    traced distance `d` from that mean exceeds it (`sigma` in arcsec, source plane; small,
    so the penalty is a steep wall).

    The guard of the established pipelines against the "demagnified" solutions of a
    pixelized source (a mass model that maps the arcs to a large, smeared source fits the
    data about as well; e.g. PyAutoLens's positions likelihood with its threshold, which
    `equilens.solve.fit_pixelized` follows with positions found by
    `equilens.solve.auto_positions`). Not a likelihood: inside the threshold it leaves the
    objective and its gradient unchanged; its constant is zero.

    `model` is a `LensSystem` or a mass profile.
    """

    x: Float[Array, " n_images"] = eqx.field(converter=_vector)
    y: Float[Array, " n_images"] = eqx.field(converter=_vector)
    threshold: Float[Array, ""] = eqx.field(converter=as_float)
    sigma: Float[Array, ""] = eqx.field(converter=as_float)

    def __check_init__(self):
        if self.x.ndim != 1 or self.x.shape != self.y.shape or self.x.shape[0] < 2:
            raise ValueError(
                f"PositionsThreshold needs x and y of the same length >= 2, got shapes "
                f"{self.x.shape} and {self.y.shape}"
            )

    def residuals(
        self, model: LensSystem | MultiBandLensSystem | AbstractMassProfile
    ) -> Float[Array, " n"]:
        mass = model.mass if isinstance(model, LensSystem | MultiBandLensSystem) else model
        bx, by = mass.ray_shoot(self.x, self.y)
        return threshold_excess(jnp, bx, by, self.threshold, self.sigma)

    def constant(self) -> Scalar:
        return jnp.zeros((), self.sigma.dtype)
