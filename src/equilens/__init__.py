"""equilens: strong gravitational lens modelling with JAX and Equinox.

Conventions: angles in arcsec; image arrays `a[i, j]` with x growing with the column `j` and
y with the row `i`; position angles in radians counter-clockwise from +x; ellipticity
`(e1, e2) = (1-q)/(1+q) (cos 2phi, sin 2phi)`; lenstronomy's parameter names and
normalisations for shared profiles.
"""

from . import data as data, lensing as lensing, light as light, mass as mass, psf as psf
from ._grid import Grid as Grid, MaskedGrid as MaskedGrid
from ._lens_system import LensSystem as LensSystem
from ._math import (
    ellipticity_from_q_phi as ellipticity_from_q_phi,
    q_phi_from_ellipticity as q_phi_from_ellipticity,
)
from .data import Imaging as Imaging, simulate as simulate
from .psf import GaussianPSF as GaussianPSF, PixelPSF as PixelPSF

__version__ = "0.1.0"
