"""An objective: a weighted sum of terms over a model pytree."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PyTree, Scalar

from ..terms import (
    AbstractDataTerm,
    AbstractImagingTerm,
    AbstractLeastSquaresTerm,
    AbstractTerm,
    MultiBandTerm,
)


class Objective(eqx.Module):
    """`objective(model) = sum_i weights[i] * terms[i](model)`: the negative log posterior
    (up to the evidence) that `equilens.fit` minimises.

    **Arguments:** `terms` (a term or a sequence of terms); `weights` (default all 1; an
    array field, so a survey can batch over it).

    When every term is a least-squares term, `residuals(model)` concatenates the whitened
    residuals `sqrt(w_i) r_i`, and `objective(model) = 0.5 |residuals|^2 + constant()`:
    that is what Levenberg-Marquardt uses.
    """

    terms: tuple[AbstractTerm, ...]
    weights: Float[Array, " n_terms"]

    def __init__(
        self,
        terms: AbstractTerm | Sequence[AbstractTerm],
        weights: Sequence[float] | Float[ArrayLike, " n_terms"] | None = None,
    ):
        terms = (terms,) if isinstance(terms, AbstractTerm) else tuple(terms)
        if not terms:
            raise ValueError("an Objective needs at least one term")
        for t in terms:
            if not isinstance(t, AbstractTerm):
                raise TypeError(f"Objective terms must be AbstractTerm instances, got {type(t)}")
        self.terms = terms
        dtype = jnp.result_type(float)
        w = jnp.ones(len(terms), dtype) if weights is None else jnp.asarray(weights, dtype)
        if w.shape != (len(terms),):
            raise ValueError(f"weights must have shape ({len(terms)},), got {w.shape}")
        self.weights = w

    def values(self, model: PyTree[Any]) -> Float[Array, " n_terms"]:
        """Each term's (unweighted) value."""
        return jnp.stack([t(model) for t in self.terms])

    def __call__(self, model: PyTree[Any]) -> Scalar:
        return jnp.sum(self.weights * self.values(model))

    @property
    def least_squares(self) -> bool:
        """True when every term has whitened residuals (Levenberg-Marquardt applies)."""
        return all(t.least_squares for t in self.terms)

    def residuals(self, model: PyTree[Any]) -> Float[Array, " n"]:
        """Whitened residuals of all terms, each scaled by `sqrt(weight)`, concatenated.

        Raises `TypeError` if a term is not a least-squares term."""
        parts = []
        for w, t in zip(self.weights, self.terms, strict=True):
            if not isinstance(t, AbstractLeastSquaresTerm | MultiBandTerm) or not t.least_squares:
                raise TypeError(
                    f"{type(t).__name__} has no least-squares form (no whitened residuals): "
                    "use a minimiser (e.g. solver='bfgs') instead of Levenberg-Marquardt"
                )
            parts.append(jnp.sqrt(w) * t.residuals(model))
        return jnp.concatenate(parts)

    def constant(self) -> Scalar:
        """`objective - 0.5 |residuals|^2` (least-squares objectives only)."""
        out = jnp.zeros((), self.weights.dtype)
        for w, t in zip(self.weights, self.terms, strict=True):
            if not isinstance(t, AbstractLeastSquaresTerm | MultiBandTerm) or not t.least_squares:
                raise TypeError(f"{type(t).__name__} is not a least-squares term")
            out = out + w * t.constant()
        return out

    def data_terms(self) -> tuple[AbstractDataTerm, ...]:
        """The likelihood terms (imaging terms, multi-band terms), in order."""
        return tuple(t for t in self.terms if isinstance(t, AbstractDataTerm))

    def imaging_terms(self) -> tuple[AbstractImagingTerm, ...]:
        """Every single-band imaging term, those inside a `MultiBandTerm` included."""
        out: list[AbstractImagingTerm] = []
        for t in self.data_terms():
            if isinstance(t, MultiBandTerm):
                out.extend(t.terms)
            elif isinstance(t, AbstractImagingTerm):
                out.append(t)
        return tuple(out)

    def complete(self, model: PyTree[Any]) -> PyTree[Any]:
        """`model` with the linear parts solved by the first data term that solves them
        (`linear=True`); unchanged if none does."""
        for t in self.data_terms():
            if t.solves_linear:
                return t.complete(model)
        return model

    def solves_linear(self) -> bool:
        """Whether a data term solves linear parts of the model (so they are not fitted)."""
        return any(t.solves_linear for t in self.data_terms())

    def chi2(self, model: PyTree[Any]) -> Scalar:
        """Sum of the data terms' chi2 (normalised residuals squared over their masks)."""
        out = jnp.zeros((), self.weights.dtype)
        for t in self.data_terms():
            out = out + t.chi2(model)
        return out

    @property
    def n_data(self) -> int:
        """Number of data pixels in the data terms."""
        return sum(t.n_data for t in self.data_terms())
