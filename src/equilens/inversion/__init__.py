"""The linear inversion of a pixelized source: its routes, its linear algebra, its result.

`equilens.LogEvidence` maps a `PixelizedSource` to the image, hands the linear system to
a route (`AbstractRoute`: "dense" and "w_tilde" here, "sparse" registered by
`equilens.numba`; `AutoRoute` picks one per call) and assembles the evidence from the
route's solution (`Inversion`). A new route is a final subclass of `AbstractRoute` made
known by `register_route`. The formulas both backends evaluate (the positive-only solve's
iteration, the adapt signal, the evidence's assembly, a Gaussian-process prior's `H`) are
written once for an array namespace `xp` (`jax.numpy` or NumPy). See docs/pixelized.md
("Three routes to the curvature matrix").
"""

from ._formulas import (
    NONNEG_ITERATIONS as NONNEG_ITERATIONS,
    gp_precision as gp_precision,
    jacobi_scaling as jacobi_scaling,
    log_evidence as log_evidence,
    noise_normalisation as noise_normalisation,
    projected_gradient as projected_gradient,
    python_loop as python_loop,
    source_signal as source_signal,
)
from ._linalg import (
    HostCholesky as HostCholesky,
    Solution as Solution,
    inverse_from_factor as inverse_from_factor,
    logdet_factor as logdet_factor,
    logdet_psd as logdet_psd,
    solve_system as solve_system,
)
from ._mapping import (
    blur_mapping as blur_mapping,
    curvature_w_tilde as curvature_w_tilde,
    map_to_image as map_to_image,
    map_to_source as map_to_source,
    mapped_pixels as mapped_pixels,
    w_tilde_table as w_tilde_table,
)
from ._result import Inversion as Inversion
from ._routes import (
    W_TILDE_MAX_BYTES as W_TILDE_MAX_BYTES,
    AbstractRoute as AbstractRoute,
    AutoRoute as AutoRoute,
    DenseRoute as DenseRoute,
    LinearProblem as LinearProblem,
    RouteData as RouteData,
    Solved as Solved,
    WTildeRoute as WTildeRoute,
    choose as choose,
    prepared as prepared,
    register_route as register_route,
    route_class as route_class,
    route_names as route_names,
    solves_on_host as solves_on_host,
)
