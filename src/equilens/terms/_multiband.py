"""The joint likelihood of several bands: one imaging term per band, summed."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Scalar

from .._lens_system import LensSystem
from .._multiband import MultiBandLensSystem
from ..data import MultiBandImaging
from ..inversion import Inversion
from ._base import AbstractDataTerm, AbstractLeastSquaresTerm
from ._evidence import LogEvidence
from ._imaging import AbstractImagingTerm, GaussianLikelihood


class MultiBandTerm(AbstractDataTerm):
    """The joint likelihood of several bands of one lens: `terms[i]` (any imaging term:
    `GaussianLikelihood`, `PoissonLikelihood`, `LogEvidence`) compares band `i` of a
    `MultiBandLensSystem` (`model.band(i)`) with its data, and the joint term is their sum,

        -log L = sum_i -log L_i(model.band(i)),

    each band with its own PSF, noise, mask, pixel scale and linear solve (per-band
    amplitudes; a per-band pixelized source). `complete` fills every band in; `values`,
    `band_chi2`, `model_images` and `invert` give per-band outputs. When every band's term
    is a least-squares term, so is the joint one (`residuals` concatenates the bands').

    **Arguments:** `terms` (one imaging term per band); `names` (one per band; default
    "band0", ...). `MultiBandTerm.build(dataset, GaussianLikelihood, **options)` makes one
    term of a class per band of a `MultiBandImaging` (its band names).
    """

    terms: tuple[AbstractImagingTerm, ...]
    names: tuple[str, ...] = eqx.field(static=True)

    def __init__(self, terms: Sequence[AbstractImagingTerm], names: Sequence[str] | None = None):
        terms = tuple(terms)
        if not terms:
            raise ValueError("MultiBandTerm needs at least one band's term")
        for i, t in enumerate(terms):
            if not isinstance(t, AbstractImagingTerm):
                raise TypeError(
                    f"MultiBandTerm band {i}: expected an imaging term (e.g. "
                    f"GaussianLikelihood), got {type(t).__name__}"
                )
        names = tuple(f"band{i}" for i in range(len(terms))) if names is None else tuple(names)
        if len(names) != len(terms):
            raise ValueError(f"{len(names)} names for {len(terms)} bands")
        if len(set(names)) != len(names):
            raise ValueError(f"band names must be unique, got {names}")
        self.terms = terms
        self.names = names

    @classmethod
    def build(
        cls, dataset: MultiBandImaging, term: type = GaussianLikelihood, **options: Any
    ) -> "MultiBandTerm":
        """`MultiBandTerm([term(band, **options) for band in dataset.bands], dataset.names)`."""
        if not isinstance(dataset, MultiBandImaging):
            raise TypeError(f"expected a MultiBandImaging, got {type(dataset).__name__}")
        return cls([term(band, **options) for band in dataset.bands], dataset.names)

    @property
    def n_bands(self) -> int:
        return len(self.terms)

    def _bands(self, model: MultiBandLensSystem) -> tuple[LensSystem, ...]:
        if not isinstance(model, MultiBandLensSystem):
            raise TypeError(
                f"MultiBandTerm needs a MultiBandLensSystem model, got {type(model).__name__}"
            )
        if model.n_bands != self.n_bands:
            raise ValueError(f"the model has {model.n_bands} bands and the term {self.n_bands}")
        return model.bands()

    def values(self, model: MultiBandLensSystem) -> Float[Array, " n_bands"]:
        """Each band's term value (`-log L_i`)."""
        return jnp.stack([t(s) for t, s in zip(self.terms, self._bands(model), strict=True)])

    def __call__(self, model: MultiBandLensSystem) -> Scalar:
        return jnp.sum(self.values(model))

    @property
    def solves_linear(self) -> bool:
        return any(t.solves_linear for t in self.terms)

    @property
    def n_data(self) -> int:
        """Pixels in all bands' masks."""
        return sum(t.n_data for t in self.terms)

    def complete(self, model: MultiBandLensSystem) -> MultiBandLensSystem:
        """`model` with each band's linear parts (amplitudes, pixelized source) solved by
        its term, and shared shapes written into every band's copy."""
        done = [t.complete(s) for t, s in zip(self.terms, self._bands(model), strict=True)]
        return model.with_bands(done)

    def band_chi2(self, model: MultiBandLensSystem) -> Float[Array, " n_bands"]:
        """Each band's chi2 over its mask."""
        return jnp.stack([t.chi2(s) for t, s in zip(self.terms, self._bands(model), strict=True)])

    def chi2(self, model: MultiBandLensSystem) -> Scalar:
        return jnp.sum(self.band_chi2(model))

    def model_images(self, model: MultiBandLensSystem) -> tuple[Float[Array, "ny nx"], ...]:
        """Each band's model image (flux per pixel), linear parts solved."""
        return tuple(t.model_image(s) for t, s in zip(self.terms, self._bands(model), strict=True))

    def invert(self, model: MultiBandLensSystem, errors: bool = False) -> tuple[Inversion, ...]:
        """Each band's linear inversion (every band's term must be a `LogEvidence`); with
        `errors`, the 1-sigma errors of the source values too (`LogEvidence.invert`)."""
        out = []
        for name, t, s in zip(self.names, self.terms, self._bands(model), strict=True):
            if not isinstance(t, LogEvidence):
                raise TypeError(f"band {name!r} has no inversion: its term is not LogEvidence")
            out.append(t.invert(s, errors=errors))
        return tuple(out)

    @property
    def least_squares(self) -> bool:
        """Whether every band's term is a least-squares term (has whitened residuals)."""
        return all(isinstance(t, AbstractLeastSquaresTerm) for t in self.terms)

    def _least_squares_terms(self) -> tuple[AbstractLeastSquaresTerm, ...]:
        out = []
        for name, t in zip(self.names, self.terms, strict=True):
            if not isinstance(t, AbstractLeastSquaresTerm):
                raise TypeError(
                    f"band {name!r}: {type(t).__name__} has no least-squares form (no "
                    "whitened residuals)"
                )
            out.append(t)
        return tuple(out)

    def residuals(self, model: MultiBandLensSystem) -> Float[Array, " n"]:
        """The bands' whitened residuals, concatenated in band order (least-squares band
        terms only; `TypeError` otherwise)."""
        terms = self._least_squares_terms()
        return jnp.concatenate(
            [t.residuals(s) for t, s in zip(terms, self._bands(model), strict=True)]
        )

    def constant(self) -> Scalar:
        """The sum of the bands' normalisation constants (least-squares band terms only)."""
        return sum((t.constant() for t in self._least_squares_terms()), jnp.zeros(()))
