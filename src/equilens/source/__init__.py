"""Pixelized sources: meshes, interpolation, the mapping operator and the linear inversion.

A `PixelizedSource(mesh, regularization)` is the source of a `LensSystem`; the
`equilens.LogEvidence` term solves for its values and scores the lens model by the
Bayesian evidence. See docs/pixelized.md.
"""

from ._geometry import (
    AbstractGeometry as AbstractGeometry,
    RectilinearGeometry as RectilinearGeometry,
    SparseSymmetric as SparseSymmetric,
    TriangulationGeometry as TriangulationGeometry,
)
from ._inversion import Inversion as Inversion, mapped_pixels as mapped_pixels
from ._mesh import (
    AbstractMesh as AbstractMesh,
    AdaptiveRectangularMesh as AdaptiveRectangularMesh,
    DelaunayMesh as DelaunayMesh,
    RectangularMesh as RectangularMesh,
)
from ._pixelized import (
    AbstractRegularization as AbstractRegularization,
    PixelizedSource as PixelizedSource,
)
