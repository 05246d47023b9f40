"""The term interface."""

import abc
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree, Scalar


class AbstractTerm(eqx.Module):
    """One term of an objective: `term(model)` is its contribution to the quantity a fit
    minimises, a negative log probability (`-log L` of data given the model, or `-log p` of
    a prior) including its normalisation constant, so that terms add and their sum is
    `-log posterior` up to the evidence.

    `model` is the model pytree being fitted (a `LensSystem` for the imaging terms).
    """

    @abc.abstractmethod
    def __call__(self, model: PyTree[Any]) -> Scalar:
        """The term's value (a negative log probability) for `model`."""

    @property
    def least_squares(self) -> bool:
        """Whether the term is `0.5 |r|^2 + constant` with whitened residuals `r` (see
        `AbstractLeastSquaresTerm`): least-squares solvers need every term to be."""
        return False


class AbstractDataTerm(AbstractTerm):
    """A likelihood of data given the model (as opposed to a prior): it reports its chi2
    and number of data, and may solve part of the model linearly at every evaluation (light
    amplitudes, a pixelized source), which `complete` fills in."""

    @property
    @abc.abstractmethod
    def solves_linear(self) -> bool:
        """Whether the term solves part of the model linearly (not fitted by a solver)."""

    @property
    @abc.abstractmethod
    def n_data(self) -> int:
        """Number of data (pixels) the term compares with the model."""

    @abc.abstractmethod
    def complete(self, model: PyTree[Any]) -> PyTree[Any]:
        """`model` with what the term solves linearly filled in."""

    @abc.abstractmethod
    def chi2(self, model: PyTree[Any]) -> Scalar:
        """Sum of the squared normalised residuals over the data."""


class AbstractLeastSquaresTerm(AbstractTerm):
    """A term of the form `0.5 sum r^2 + constant` with whitened residuals `r`: Gaussian
    likelihoods and priors. Least-squares solvers (Levenberg-Marquardt) need every term of
    an objective to be of this kind."""

    @property
    def least_squares(self) -> bool:
        return True

    @abc.abstractmethod
    def residuals(self, model: PyTree[Any]) -> Float[Array, " n"]:
        """Whitened residuals (data minus model over its 1-sigma error), flattened."""

    @abc.abstractmethod
    def constant(self) -> Scalar:
        """The normalisation constant (independent of the model)."""

    def __call__(self, model: PyTree[Any]) -> Scalar:
        r = self.residuals(model)
        return 0.5 * jnp.sum(r * r) + self.constant()
