"""What an inversion returns (`Inversion`)."""

import equinox as eqx
from jaxtyping import Array, Bool, Float, Scalar

from .._grid import Grid
from ..source._geometry import AbstractGeometry


class Inversion(eqx.Module):
    """Everything a pixelized-source inversion produces for one lens model.

    - `values`: the source (surface brightness per arcsec^2) on the nodes of `geometry`;
      `errors`: their 1-sigma errors `sqrt(diag((F+H)^-1))` (zeros unless requested).
    - `amplitudes`: the linear light amplitudes solved in the same system (lens light,
      `LensSystem.linear_components` order).
    - `model_image`: the model (flux per pixel, PSF-convolved) on the dataset's grid;
      `residuals`: `(data - model) / noise` on the mask, zero outside.
    - `chi2`, `regularization_term` (`s^T H s`), `log_det_curvature` (`log det (F+H)`),
      `log_det_regularization` (`log det H`), `noise_normalisation` (`sum log 2 pi
      sigma^2`) and `log_evidence = -(chi2 + s^T H s + log det(F+H) - log det H + sum log
      2 pi sigma^2) / 2`, which is `-inf` when the system is singular (`valid` False;
      the solved quantities are then NaN, and the evidence's gradient is zero). (The
      "sparse" route's single host solve gives `chi2 + s^T H s` as `|t|^2 - x^T b`, with
      `t` the noise-weighted data and `b` the system's right-hand side, in float64; the
      evidence then needs no model image. The reported `chi2` is from the residuals and
      agrees to round-off.)
    - `adapt_image`: for `fit_pixelized`'s result, the brightness estimate its last kept
      stage's `LogEvidence` adapted an `AdaptiveBrightness` to (`LogEvidence.adapt_image`;
      `LogEvidence(imaging, adapt_image=inversion.adapt_image)` is that stage's term, the
      one whose evidence the fitted hyperparameters maximise); None otherwise.
    """

    values: Float[Array, " n"]
    errors: Float[Array, " n"]
    amplitudes: Float[Array, " n_linear"]
    geometry: AbstractGeometry
    model_image: Float[Array, "ny nx"]
    residuals: Float[Array, "ny nx"]
    chi2: Scalar
    regularization_term: Scalar
    log_det_curvature: Scalar
    log_det_regularization: Scalar
    noise_normalisation: Scalar
    log_evidence: Scalar
    valid: Bool[Array, ""]
    route: str = eqx.field(static=True)
    adapt_image: Float[Array, "ny nx"] | None = None

    def source_image(self, grid: Grid) -> Float[Array, "ny nx"]:
        """The source interpolated to a regular source-plane `grid` (an `equilens.Grid`):
        surface brightness per arcsec^2 at the pixel centres."""
        x, y = grid.coordinates()
        return self.geometry.values_at(self.values, x, y)

    def error_image(self, grid: Grid) -> Float[Array, "ny nx"]:
        """The 1-sigma errors interpolated to a regular source-plane `grid`."""
        x, y = grid.coordinates()
        return self.geometry.values_at(self.errors, x, y)
