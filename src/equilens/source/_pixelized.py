"""A pixelized source: values on a mesh, solved by a regularized linear inversion."""

import abc
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Scalar

from .._checks import check_fields, describe
from .._custom_types import GridArray, as_float
from ..light import AbstractLightProfile
from ._geometry import AbstractGeometry, SparseSymmetric
from ._mesh import AbstractMesh


class AbstractRegularization(eqx.Module):
    """A Gaussian prior on the source values `s`: `p(s) ~ exp(-s^T H s / 2)`.

    `matrix(geometry, signal)` returns `H` (`n x n`, positive definite) and `log det H`;
    `signal` is a brightness estimate per source pixel in `[0, 1]` (used by adaptive
    schemes; ignored otherwise). Strength parameters are array fields, so a fit can vary
    them (by maximising the Bayesian evidence); their descriptions (`equilens.describe`:
    `domain`, `bounds`) keep them positive.

    A regularization whose `H` is sparse (a few neighbours per pixel) also gives it as a
    `SparseSymmetric` from `sparse_matrix` (None, the default, when it has no sparse
    form): the inversion then never forms the dense `H` where it need not (the "sparse"
    curvature route adds its entries on the host, and differentiates them alone).
    """

    #: Whether `matrix` uses the brightness `signal` (the inversion skips computing it if not).
    uses_signal: ClassVar[bool] = False
    #: Whether `H`'s zero entries stay zero whatever the parameters (its derivative is zero
    #: wherever `H` is): the sparse route's gradient then forms `(F + H)^-1` only on the
    #: envelope of `F + H` (a selected inverse). True for every built-in regularization;
    #: leave it False for a custom `H` whose pattern of zeros can change.
    fixed_sparsity: ClassVar[bool] = False
    #: Whether the `log det H` of `sparse_matrix` is a factorisation of its entries (not a
    #: closed form): a route with its own factorisation of entries then takes it
    #: (`AbstractRoute.entries_logdet`: the CPU's sparse route, on the entries' envelope),
    #: not the dense `H`'s.
    factored_logdet: ClassVar[bool] = False

    def __check_init__(self):
        check_fields(self)

    @abc.abstractmethod
    def matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[Float[Array, "n n"], Scalar]:
        """The regularization matrix `H` and `log det H`."""

    def sparse_matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[SparseSymmetric, Scalar] | None:
        """`H` (the same matrix as `matrix`'s) by its non-zero entries and `log det H`, or
        None when `H` has no sparse form (the default). Its pattern must depend on the
        geometry's structure only (its shape or triangulation), never on parameters. (A
        subclass that overrides `matrix` but not `sparse_matrix` is inverted with its
        `matrix`: see `regularization_matrix`.)"""
        del geometry, signal
        return None


def _defined_in(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in vars(k))


def regularization_matrix(
    regularization: AbstractRegularization,
    geometry: AbstractGeometry,
    signal: Float[Array, " n"],
) -> tuple[Float[Array, "n n"] | SparseSymmetric, Scalar]:
    """The regularization's `H` (and `log det H`) as the inversion uses it: its
    `sparse_matrix` when it has one that is at least as derived as its `matrix` (so that
    a subclass overriding only `matrix` is not bypassed), else the dense `matrix`."""
    cls = type(regularization)
    if issubclass(_defined_in(cls, "sparse_matrix"), _defined_in(cls, "matrix")):
        sparse = regularization.sparse_matrix(geometry, signal)
        if sparse is not None:
            return sparse
    return regularization.matrix(geometry, signal)


class PixelizedSource(AbstractLightProfile):
    """A source whose surface brightness (per arcsec^2) is given by values on the pixels of
    a `mesh`, interpolated between them, and solved for by a linear inversion regularized
    by `regularization` (see `equilens.LogEvidence`). Slots into `LensSystem(source=...)`.

    **Arguments:** `mesh` (e.g. `RectangularMesh((32, 32))`), `regularization` (e.g.
    `ConstantRegularization(1.0)`); `values`, `geometry`: the solved source and the mesh
    it lives on, filled in by `LogEvidence.complete` / `equilens.fit` (zeros until then,
    so an unsolved source emits no light). The fit never varies them directly.
    """

    mesh: AbstractMesh
    regularization: AbstractRegularization
    values: Float[Array, " n"] = eqx.field(metadata=describe(fixed=True))
    geometry: AbstractGeometry

    def __init__(
        self,
        mesh: AbstractMesh,
        regularization: AbstractRegularization,
        values: Float[Array, " n"] | None = None,
        geometry: AbstractGeometry | None = None,
    ):
        if not isinstance(mesh, AbstractMesh):
            raise TypeError(f"PixelizedSource.mesh must be an AbstractMesh, got {type(mesh)}")
        if not isinstance(regularization, AbstractRegularization):
            raise TypeError(
                "PixelizedSource.regularization must be an AbstractRegularization, got "
                f"{type(regularization)}"
            )
        n = mesh.n_pixels
        self.mesh = mesh
        self.regularization = regularization
        self.values = jnp.zeros(n, jnp.result_type(float)) if values is None else as_float(values)
        self.geometry = mesh.placeholder() if geometry is None else geometry
        if self.values.shape != (n,):
            raise ValueError(f"values must have shape ({n},), got {self.values.shape}")

    @property
    def n_pixels(self) -> int:
        return self.mesh.n_pixels

    def intensity(self, x: GridArray, y: GridArray) -> GridArray:
        """The solved source interpolated at source-plane positions `(x, y)` (arcsec)."""
        return self.geometry.values_at(self.values, x, y)
