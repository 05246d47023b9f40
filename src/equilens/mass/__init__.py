"""Mass profiles: deflection, potential, convergence and Hessian of lensing masses."""

from ._base import (
    AbstractMassProfile as AbstractMassProfile,
    MassBatch as MassBatch,
    MassSum as MassSum,
)
from ._multiplane import MultiPlane as MultiPlane
from ._nfw import NFW as NFW, EllipticalNFW as EllipticalNFW
from ._power_law import EPL as EPL, SIE as SIE, SIS as SIS
from ._simple import (
    ConvergenceSheet as ConvergenceSheet,
    ExternalShear as ExternalShear,
    Multipole as Multipole,
    PointMass as PointMass,
)
from ._subhalo import TNFW as TNFW, PseudoJaffe as PseudoJaffe
