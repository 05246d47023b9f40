"""Objective terms: data fidelity (imaging likelihoods, image positions) and priors.

Every term returns its contribution to the objective that a fit minimises: a negative log
probability in natural units (`-log L`, including normalisation constants), so terms add.
Least-squares terms also expose whitened residuals `r` with `value = 0.5 sum r^2 + constant`.
"""

from ._base import (
    AbstractDataTerm as AbstractDataTerm,
    AbstractLeastSquaresTerm as AbstractLeastSquaresTerm,
    AbstractTerm as AbstractTerm,
)
from ._evidence import LogEvidence as LogEvidence, with_inversion as with_inversion
from ._imaging import (
    AbstractImagingTerm as AbstractImagingTerm,
    AbstractParametricImagingTerm as AbstractParametricImagingTerm,
    GaussianLikelihood as GaussianLikelihood,
    PoissonLikelihood as PoissonLikelihood,
    solve_amplitudes as solve_amplitudes,
)
from ._multiband import MultiBandTerm as MultiBandTerm
from ._positions import (
    PositionsTerm as PositionsTerm,
    PositionsThreshold as PositionsThreshold,
)
from ._priors import (
    GaussianPrior as GaussianPrior,
    LogisticPrior as LogisticPrior,
    UniformPrior as UniformPrior,
)
