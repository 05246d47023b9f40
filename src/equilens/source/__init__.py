"""Pixelized sources: meshes, interpolation, the mapping operator and the linear inversion.

A `PixelizedSource(mesh, regularization)` is the source of a `LensSystem`; the
`equilens.LogEvidence` term solves for its values and scores the lens model by the
Bayesian evidence. See docs/pixelized.md. The inversion itself (its routes, linear algebra
and result, `Inversion`) is `equilens.inversion`; `equilens.source.Inversion` and
`mapped_pixels` remain as its names from before.
"""

from ._geometry import (
    AbstractGeometry as AbstractGeometry,
    RectilinearGeometry as RectilinearGeometry,
    SparseSymmetric as SparseSymmetric,
    TriangulationGeometry as TriangulationGeometry,
)
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


def __getattr__(name: str):
    # (the inversion imports this package's geometry: its names are looked up on use)
    if name in ("Inversion", "mapped_pixels"):
        from .. import inversion

        return getattr(inversion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
