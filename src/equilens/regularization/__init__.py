"""Regularizations of pixelized sources: Gaussian priors `exp(-s^T H s / 2)` on the source
values, with `log det H` for the Bayesian evidence."""

from ..source._geometry import SparseSymmetric as SparseSymmetric
from ..source._pixelized import AbstractRegularization as AbstractRegularization
from ._regularization import (
    AdaptiveBrightness as AdaptiveBrightness,
    ConstantRegularization as ConstantRegularization,
    CurvatureRegularization as CurvatureRegularization,
    ExponentialKernel as ExponentialKernel,
    MaternKernel as MaternKernel,
)
