"""Fitting: `fit` (one start), `fit_batch` and `multi_start` (batches of starts or
objectives: a loop of compiled fits on a CPU, vmapped on an accelerator, `batch_route`),
`search` (a global first stage: many starts screened, the best refined),
`FitResult` and its `RESULTS` codes, `sample` (NUTS posterior draws, a `Posterior`),
`nested_sample` (nautilus: weighted points and the evidence, a `NestedPosterior`),
plausibility checks, the mask grown to the arcs (`fit_to_arcs`), the Laplace
evidence (`laplace_evidence`), saving and loading."""

from ._batch import (
    MultiStart as MultiStart,
    batch_route as batch_route,
    fit_batch as fit_batch,
    multi_start as multi_start,
    pick as pick,
    sample_starts as sample_starts,
)
from ._chain_start import (
    START_GAIN as START_GAIN,
    pixelized_model as pixelized_model,
    rank_starts as rank_starts,
)
from ._covariance import (
    with_conditional_covariance as with_conditional_covariance,
    with_smoothed_covariance as with_smoothed_covariance,
)
from ._fit import fit as fit
from ._io import (
    load as load,
    result_to_dict as result_to_dict,
    save as save,
    write_json as write_json,
)
from ._laplace import (
    LaplaceEvidence as LaplaceEvidence,
    laplace_evidence as laplace_evidence,
)
from ._mask import (
    MaskGrowth as MaskGrowth,
    fit_to_arcs as fit_to_arcs,
    grow_mask as grow_mask,
)
from ._nested import (
    NestedInterrupted as NestedInterrupted,
    NestedPosterior as NestedPosterior,
    nested_sample as nested_sample,
)
from ._pipeline import (
    arc_center as arc_center,
    auto_positions as auto_positions,
    fit_lens as fit_lens,
    fit_multiband as fit_multiband,
    lens_bounds as lens_bounds,
    mass_anchor as mass_anchor,
)
from ._pixelized import (
    POWER_LAW_GAIN as POWER_LAW_GAIN,
    as_power_law as as_power_law,
    fit_multiband_pixelized as fit_multiband_pixelized,
    fit_pixelized as fit_pixelized,
    newton_start as newton_start,
    refit_lens_light as refit_lens_light,
    threshold_term as threshold_term,
)
from ._plausible import implausible_notes as implausible_notes
from ._residuals import (
    ArcResiduals as ArcResiduals,
    arc_residuals as arc_residuals,
    lens_arc_residuals as lens_arc_residuals,
)
from ._resolution import (
    MAX_FILL as MAX_FILL,
    MESH_GAIN as MESH_GAIN,
    MESH_STEP as MESH_STEP,
    finer_mesh as finer_mesh,
)
from ._result import RESULTS as RESULTS, FitResult as FitResult
from ._rivals import (
    RIVAL_THETA_E as RIVAL_THETA_E,
    RIVAL_TOLERANCE as RIVAL_TOLERANCE,
    with_earlier_rivals as with_earlier_rivals,
    with_rival_minima as with_rival_minima,
)
from ._sample import (
    Posterior as Posterior,
    SamplingInterrupted as SamplingInterrupted,
    sample as sample,
)
from ._search import (
    ArcPlacement as ArcPlacement,
    Search as Search,
    arc_placement as arc_placement,
    lens_search_space as lens_search_space,
    search as search,
)
from ._solvers import SOLVER_NAMES as SOLVER_NAMES
from ._start import (
    LightMoments as LightMoments,
    light_moments as light_moments,
    start_model as start_model,
)
