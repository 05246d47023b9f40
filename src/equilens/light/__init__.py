"""Light profiles: surface brightness per arcsec^2 (parametric and linear bases)."""

from ._base import (
    AbstractLightProfile as AbstractLightProfile,
    AbstractLinearLightProfile as AbstractLinearLightProfile,
    FixedLight as FixedLight,
    LightSum as LightSum,
)
from ._gaussian import MGE as MGE, Gaussian as Gaussian
from ._sersic import CoreSersic as CoreSersic, Sersic as Sersic, sersic_b_n as sersic_b_n
from ._shapelets import Shapelets as Shapelets, shapelet_indices as shapelet_indices
