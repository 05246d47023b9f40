"""equilens: strong gravitational lens modelling with JAX and Equinox.

Conventions: angles in arcsec; image arrays `a[i, j]` with x growing with the column `j` and
y with the row `i`; position angles in radians counter-clockwise from +x; ellipticity
`(e1, e2) = (1-q)/(1+q) (cos 2phi, sin 2phi)`; lenstronomy's parameter names and
normalisations for shared profiles.
"""

from . import (
    cosmology as cosmology,
    data as data,
    inversion as inversion,
    lensing as lensing,
    light as light,
    mass as mass,
    objective as objective,
    psf as psf,
    regularization as regularization,
    solve as solve,
    source as source,
    subhalo as subhalo,
    substructure as substructure,
    terms as terms,
)
from ._cache import (
    _configure_on_import,
    compilation_cache as compilation_cache,
    default_cache_dir as default_cache_dir,
)
from ._checks import (
    NON_NEGATIVE as NON_NEGATIVE,
    POSITIVE as POSITIVE,
    Domain as Domain,
    PrecisionWarning as PrecisionWarning,
    describe as describe,
)
from ._grid import Grid as Grid, MaskedGrid as MaskedGrid
from ._lens_system import LensSystem as LensSystem
from ._math import (
    ellipticity_from_q_phi as ellipticity_from_q_phi,
    q_phi_from_ellipticity as q_phi_from_ellipticity,
)
from ._multiband import MultiBandLensSystem as MultiBandLensSystem
from ._resources import ResourceLimitWarning as ResourceLimitWarning
from ._sharding import device_mesh as device_mesh, shard as shard
from .cosmology import LensCosmology as LensCosmology
from .data import (
    DataWarning as DataWarning,
    Imaging as Imaging,
    MultiBandImaging as MultiBandImaging,
    simulate as simulate,
    simulate_batch as simulate_batch,
)
from .objective import Objective as Objective, select as select
from .psf import GaussianPSF as GaussianPSF, PixelPSF as PixelPSF
from .regularization import (
    AdaptiveBrightness as AdaptiveBrightness,
    ConstantRegularization as ConstantRegularization,
    CurvatureRegularization as CurvatureRegularization,
    ExponentialKernel as ExponentialKernel,
    MaternKernel as MaternKernel,
)
from .solve import (
    RESULTS as RESULTS,
    FitResult as FitResult,
    NestedInterrupted as NestedInterrupted,
    NestedPosterior as NestedPosterior,
    Posterior as Posterior,
    SamplingInterrupted as SamplingInterrupted,
    fit as fit,
    fit_batch as fit_batch,
    nested_sample as nested_sample,
    sample as sample,
    search as search,
)
from .source import (
    AdaptiveRectangularMesh as AdaptiveRectangularMesh,
    DelaunayMesh as DelaunayMesh,
    PixelizedSource as PixelizedSource,
    RectangularMesh as RectangularMesh,
)
from .subhalo import (
    Subhalo as Subhalo,
    SubhaloEvidence as SubhaloEvidence,
    SubhaloScan as SubhaloScan,
    subhalo_evidence as subhalo_evidence,
    subhalo_scan as subhalo_scan,
)
from .terms import (
    GaussianLikelihood as GaussianLikelihood,
    GaussianPrior as GaussianPrior,
    LogEvidence as LogEvidence,
    MultiBandTerm as MultiBandTerm,
    PoissonLikelihood as PoissonLikelihood,
    PositionsTerm as PositionsTerm,
    PositionsThreshold as PositionsThreshold,
    UniformPrior as UniformPrior,
)

__version__ = "0.1.0"

# compiled programs kept on disk between runs (equilens._cache: EQUILENS_COMPILATION_CACHE=0
# leaves JAX's configuration alone)
_configure_on_import()

# The Numba backend (Numba itself is imported on its first use): it registers the
# pixelized inversion's "sparse" route with `equilens.inversion`.
from . import numba as numba  # noqa: E402

#: Submodules imported on first use (matplotlib): `el.plot.plot_fit(...)` works after
#: `import equilens as el` alone.
_LAZY = ("plot",)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'equilens' has no attribute {name!r}")
