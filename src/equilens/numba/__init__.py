"""The Numba CPU backend: the same model objects, evaluated by Numba kernels on all cores.

`equilens.numba.deflection(profile, x, y)` equals `profile.deflection(x, y)`, and likewise
`potential`, `hessian`, `convergence`, `ray_shoot`, `magnification`, `intensity`, `basis`
and `surface_brightness`; `image(system, grid, psf)` equals `system.image(grid, psf)`,
`linear_images` and `solve_amplitudes` their JAX namesakes, and `value(objective, model)`
equals `objective(model)` for every term (imaging likelihoods, positions in either plane,
priors, and the pixelized source's `LogEvidence`, whose pieces `invert(term, system)`
gives). `log_density(objective, model)` makes `-objective` a plain function of a NumPy
parameter vector, for samplers.
They are computed by compiled kernels that run `numba.prange` over the pixels (PSF
convolutions by `scipy.fft` with as many workers, or directly for small kernels), from
NumPy inputs to float64 NumPy outputs. No JAX tracing and no compilation per shape: the
kernels compile once (on first use; cached on disk) and then serve any grid. Use it
where a plain NumPy-in / NumPy-out evaluation is what you need (gradient-free samplers,
host code); the JAX methods remain the ones to differentiate, jit and run on devices.
The two agree to round-off (tests/test_numba.py checks every profile to 1e-10).

Threads: `numba.set_num_threads(n)` or `NUMBA_NUM_THREADS` (before Numba is imported).
Calls from several Python threads are safe (kernel launches are serialised).

Every final class has one kernel, registered by class (exactly that class, not its
subclasses): `register_mass`, `register_basis` (linear light profiles) and
`register_intensity`; source meshes and regularizations likewise (`register_mesh`,
`register_regularization`), and objective terms (`register_term`). A class without one
raises `NotImplementedError` naming it; `supported(cls)` says whether one is registered.
All of equilens's `@numba.njit` code lives in this subpackage, including the pixelized
inversion's "sparse" route (`SparseRoute`: tiled kernels, host Cholesky and factor store),
which registers itself with `equilens.inversion` on import.
"""

from ._api import (
    basis as basis,
    convergence as convergence,
    deflection as deflection,
    hessian as hessian,
    intensity as intensity,
    magnification as magnification,
    potential as potential,
    ray_shoot as ray_shoot,
)
from ._evidence import (
    Evidence as Evidence,
    Rectilinear as Rectilinear,
    Triangulation as Triangulation,
    geometry as geometry,
    invert as invert,
    register_mesh as register_mesh,
    register_regularization as register_regularization,
    regularization_matrix as regularization_matrix,
)
from ._image import (
    convolve as convolve,
    coordinates as coordinates,
    image as image,
    linear_images as linear_images,
    surface_brightness as surface_brightness,
)
from ._registry import (
    register_basis as register_basis,
    register_intensity as register_intensity,
    register_mass as register_mass,
)
from ._sparse_route import SparseRoute as SparseRoute
from ._supported import supported as supported
from ._terms import (
    LogDensity as LogDensity,
    log_density as log_density,
    register_term as register_term,
    solve_amplitudes as solve_amplitudes,
    value as value,
    values as values,
)
