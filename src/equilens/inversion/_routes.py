"""The routes of a pixelized inversion: ways of building and solving its linear system.

Every route solves the same system (`equilens.terms.LogEvidence`): the source values `s`
and linear lens-light amplitudes `a` from

    [[L L^T, E_L^T], [E_L, F + H]] [a, s] = [L t, D],

with `C = W^(1/2) B M` (the blurred, noise-weighted mapping, mask pixels x source
pixels), `F = C^T C`, `D = C^T t`, `E_L = C^T L^T`, `t` the noise-weighted data and `L`
the noise-weighted lens-light images. They differ in how `F` (and `D`, `E_L`) are formed:

- "dense" (`DenseRoute`): `C` column by column (one batched FFT convolution of the
  mapping images), then `C^T C` in one matrix product: `O(n_source^2 n_mask)` flops, what
  an accelerator does best;
- "w_tilde" (`WTildeRoute`): `F = M^T W~ M` with `W~ = B^T W B` precomputed once per
  dataset as a banded table, `O(n_mapped (2K-1)^2 v)` scatter-adds, independent of the
  number of source pixels;
- "sparse" (`equilens.numba.SparseRoute`, registered by the Numba backend): the tiled
  Numba kernels and a host Cholesky, the CPU default.

A route is an Equinox module made once per dataset (`prepare`, from NumPy tables) and
called once per model (`solve`). `AutoRoute` holds the routes "auto" may use and picks
one per call (like lineax's `AutoLinearSolver`). `register_route` adds a route by name.
"""

import abc
from typing import ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Scalar

from ..psf import FFTConvolution
from ..source._geometry import SparseSymmetric
from ._linalg import HostCholesky, Solution, solve_system
from ._mapping import blur_mapping, curvature_w_tilde, map_to_source, w_tilde_table

#: The largest banded W~ table "auto" precomputes (bytes: indices + values).
W_TILDE_MAX_BYTES = 2**30
# Route costs measured on one CPU core (benchmarks/bench_pixelized.py, float64): seconds
# per multiply-add of the dense Gram matrix and per scatter-add of the w-tilde route.
_DENSE_COST = 7.0e-11
_W_TILDE_COST = 1.0e-8


class RouteData(eqx.Module):
    """What a route prepares its per-dataset tables from (NumPy, made once by
    `LogEvidence`): the PSF `kernel` at the data resolution, the weights `1/sigma^2` on
    the mask (zero elsewhere, `(ny, nx)`), the flat indices of the mask's pixels
    (`pixels`, the rows of `C`) and of the mapped pixels (`mapped`: the mask grown by the
    PSF half-widths, the rows of the interpolation), the dtype of the data and the JAX
    platform the term was made on ("cpu", "gpu", ...)."""

    kernel: Float[np.ndarray, "ky kx"]
    weight: Float[np.ndarray, "ny nx"]
    pixels: Int[np.ndarray, " n"]
    mapped: Int[np.ndarray, " p"]
    dtype: np.dtype = eqx.field(static=True)
    platform: str = eqx.field(static=True)


class Solved(eqx.Module):
    """What a route returns: the `solution` of the whole system; `fit`, `chi2 + s^T H s`
    at the solution where the route's solve gives it (else None: the evidence then takes
    it from the model image); `block_log_det`, `log det` of the source block alone when
    the amplitudes are held at their solved values (`LinearProblem.profiled`), else None."""

    solution: Solution
    fit: Scalar | None = None
    block_log_det: Scalar | None = None


class LinearProblem(eqx.Module):
    """One model's linear system, as every route receives it (JAX arrays).

    - `idx`, `w` `(p, k)`: the interpolation of the source over the mapped pixels' sub-pixels
      (node indices and weights, the pixel area included): the mapping `M`;
    - `target` `(n,)`: the data (less any fixed light) over the noise, on the mask pixels;
    - `light` `(n_linear, n)`: the linear lens-light images over the noise, on the mask;
    - `inv_sigma` `(n,)`: `1/sigma` on the mask pixels;
    - `regularization`: `H`, dense or by its entries (`SparseSymmetric`);
    - `positive`: the entries constrained to be `>= 0` (None: unconstrained);
    - `pixels`, `mapped`: flat indices of the mask's and the mapped pixels;
    - `convolution`: the PSF convolution of the dataset's grid;
    - `n_source`, `fixed_sparsity` (H's entries fall on the same positions for every model),
      `profiled` (the amplitudes held at their solved values: the source block's log det
      is wanted too).
    """

    idx: Int[Array, "p k"]
    w: Float[Array, "p k"]
    target: Float[Array, " n"]
    light: Float[Array, "n_linear n"]
    inv_sigma: Float[Array, " n"]
    regularization: Float[Array, "n_source n_source"] | SparseSymmetric
    positive: Bool[Array, " m"] | None
    pixels: Int[Array, " n"]
    mapped: Int[Array, " p"]
    convolution: FFTConvolution
    n_source: int = eqx.field(static=True)
    fixed_sparsity: bool = eqx.field(static=True)
    profiled: bool = eqx.field(static=True)

    def solve(
        self,
        curvature: Float[Array, "n_source n_source"],
        data_vector: Float[Array, " n_source"],
        cross: Float[Array, "n_source n_linear"],
        cholesky: HostCholesky | None = None,
    ) -> Solved:
        """The whole system from `F` (`curvature`), `D` (`data_vector`) and `E_L` (`cross`):
        `H` and the lens-light blocks added, solved by `solve_system` (with `cholesky`, a
        route's own factorisation)."""
        reg = self.regularization
        dense_reg = reg.todense() if isinstance(reg, SparseSymmetric) else reg
        light = self.light
        a = jnp.block([[light @ light.T, cross.T], [cross, curvature + dense_reg]])
        b = jnp.concatenate([light @ self.target, data_vector])
        block = None
        if self.profiled:
            block = solve_system(curvature + dense_reg, data_vector, cholesky=cholesky)
            block = block.log_det_curvature
        solution = solve_system(a, b, self.positive, cholesky=cholesky)
        return Solved(solution=solution, block_log_det=block)


class AbstractRoute(eqx.Module):
    """One way of building and solving the inversion's linear system (see the module
    docstring). `name` is what `LogEvidence(route=...)` and `Inversion.route` call it;
    `host` says whether it solves on the host CPU through callbacks (reverse-mode
    derivatives only; one device: a term on such a route cannot be sharded)."""

    name: ClassVar[str]
    host: ClassVar[bool]

    @classmethod
    @abc.abstractmethod
    def available(cls) -> bool:
        """Whether the route can run here (its dependencies are installed)."""

    @classmethod
    @abc.abstractmethod
    def prepare(cls, data: RouteData) -> "AbstractRoute":
        """The route for one dataset (its tables made once, NumPy)."""

    @abc.abstractmethod
    def cost(self, n_source: int, n_weights: int, n_pixels: int) -> float:
        """An estimate of the seconds one solve takes on one CPU core, for `n_source`
        source pixels, `n_weights` interpolation weights per image pixel and `n_pixels`
        mask pixels (`inf` when the route has no cost model)."""

    @abc.abstractmethod
    def solve(self, problem: LinearProblem, errors: bool) -> Solved:
        """Solves `problem`; with `errors`, the solution keeps its Cholesky factor (for
        the source values' errors, differentiable as on every route)."""

    def entries_logdet(self, h: SparseSymmetric) -> Scalar | None:
        """`log det h` of a regularization given by its entries (one whose `log det H` is a
        factorisation of them, `AbstractRegularization.factored_logdet`), computed the way
        this route computes its own factorisations; None (the default) to keep the
        regularization's own (its dense factorisation)."""
        del h
        return None


class DenseRoute(AbstractRoute):
    """`C = W^(1/2) B M` as images (one batched FFT convolution of the mapping images),
    then `F = C^T C` in one matrix product. No tables; always available."""

    name: ClassVar[str] = "dense"
    host: ClassVar[bool] = False

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def prepare(cls, data: RouteData) -> "DenseRoute":
        del data
        return cls()

    def cost(self, n_source: int, n_weights: int, n_pixels: int) -> float:
        del n_weights
        return _DENSE_COST * n_source**2 * n_pixels

    def solve(self, problem: LinearProblem, errors: bool) -> Solved:
        del errors
        p = problem
        conv = p.convolution
        ny, nx = conv.image_shape
        n_s = p.n_source
        blurred = blur_mapping(p.idx, p.w, n_s, p.mapped, conv)
        c = blurred.reshape(n_s, ny * nx)[:, p.pixels] * p.inv_sigma[None, :]
        return p.solve(c @ c.T, c @ p.target, c @ p.light.T)


def w_tilde_bytes(data: RouteData) -> int:
    """The size of the "w_tilde" route's banded table for `data` (indices and values)."""
    ky, kx = data.kernel.shape
    k2 = (2 * (ky // 2) + 1) * (2 * (kx // 2) + 1)
    return data.mapped.shape[0] * 4 * k2 * 16


class WTildeRoute(AbstractRoute):
    """`F = M^T W~ M` from the banded table of `W~ = B^T W B` (`neighbours`, `w_tilde`:
    `equilens.inversion.w_tilde_table`), and `D = M^T B^T W d` by one transposed
    convolution (`transpose`, the flipped kernel)."""

    neighbours: Int[Array, "p o"]
    w_tilde: Float[Array, "p o"]
    transpose: FFTConvolution
    name: ClassVar[str] = "w_tilde"
    host: ClassVar[bool] = False

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def prepare(cls, data: RouteData) -> "WTildeRoute":
        nbr, val = w_tilde_table(data.kernel, data.weight, data.mapped)
        flipped = jnp.asarray(data.kernel[::-1, ::-1], data.dtype)
        return cls(
            neighbours=jnp.asarray(nbr),
            w_tilde=jnp.asarray(val, data.dtype),
            transpose=FFTConvolution(flipped, data.weight.shape),
        )

    def cost(self, n_source: int, n_weights: int, n_pixels: int) -> float:
        del n_source, n_pixels
        return _W_TILDE_COST * self.w_tilde.size * n_weights

    def solve(self, problem: LinearProblem, errors: bool) -> Solved:
        del errors
        p = problem
        ny, nx = self.transpose.image_shape
        n_lin = p.light.shape[0]
        curvature = curvature_w_tilde(p.idx, p.w, p.n_source, self.neighbours, self.w_tilde)
        weighted = jnp.concatenate([p.target[None, :], p.light]) * p.inv_sigma[None, :]
        full = jnp.zeros((n_lin + 1, ny * nx), p.w.dtype).at[:, p.pixels].set(weighted)
        back = jax.vmap(self.transpose)(full.reshape(n_lin + 1, ny, nx))
        back = back.reshape(n_lin + 1, ny * nx)[:, p.mapped]
        projected = map_to_source(p.idx, p.w, back.T, p.n_source)
        return p.solve(curvature, projected[:, 0], projected[:, 1:])


_REGISTERED: dict[str, type[AbstractRoute]] = {"dense": DenseRoute, "w_tilde": WTildeRoute}


_R = TypeVar("_R", bound=type[AbstractRoute])


def register_route(cls: _R) -> _R:
    """Makes route `cls` (a final subclass of `AbstractRoute`) known by its `name` to
    `LogEvidence(route=...)` (a class decorator; a name registered twice is an error)."""
    if not (isinstance(cls, type) and issubclass(cls, AbstractRoute)):
        raise TypeError(f"register_route needs a subclass of AbstractRoute, got {cls!r}")
    if cls.name == "auto" or _REGISTERED.get(cls.name, cls) is not cls:
        raise ValueError(f"a route named {cls.name!r} is already registered")
    _REGISTERED[cls.name] = cls
    return cls


def route_names() -> tuple[str, ...]:
    """The names `LogEvidence(route=...)` takes: "auto" and every registered route."""
    return ("auto", *_REGISTERED)


def route_class(name: str) -> type[AbstractRoute]:
    """The registered route called `name` (an error naming the choices, or saying what
    to install when the route cannot run here)."""
    cls = _REGISTERED.get(name)
    if cls is None:
        raise ValueError(f"route must be one of {route_names()}, got {name!r}")
    if not cls.available():
        raise ImportError(
            f"route={name!r} needs Numba: pip install 'equilens[numba]' (or numba)"
            if name == "sparse"
            else f"route={name!r} cannot run here (its dependencies are not installed)"
        )
    return cls


class AutoRoute(eqx.Module):
    """The routes "auto" may take for one dataset, and its choice per call (`choose`):
    on a CPU the "sparse" route when it is registered and available (Numba; measured the
    fastest on CPU cores); else, on a CPU, the "w_tilde" route beside "dense" when its
    table takes at most `W_TILDE_MAX_BYTES`, the cheaper of the two by their `cost` for
    each model's mesh; "dense" on accelerators."""

    routes: tuple[AbstractRoute, ...]

    @classmethod
    def prepare(cls, data: RouteData) -> "AutoRoute":
        if data.platform == "cpu":
            sparse = _REGISTERED.get("sparse")
            if sparse is not None and sparse.available():
                return cls((sparse.prepare(data),))
            if w_tilde_bytes(data) <= W_TILDE_MAX_BYTES:
                return cls((DenseRoute(), WTildeRoute.prepare(data)))
        return cls((DenseRoute(),))

    def choose(self, n_source: int, n_weights: int, n_pixels: int) -> AbstractRoute:
        """The cheapest route by `cost` (the first on a tie)."""
        costs = [r.cost(n_source, n_weights, n_pixels) for r in self.routes]
        return self.routes[min(range(len(costs)), key=costs.__getitem__)]


def prepared(solver: AbstractRoute | AutoRoute) -> tuple[AbstractRoute, ...]:
    """The routes a term's `solver` holds (prepared for its dataset)."""
    return solver.routes if isinstance(solver, AutoRoute) else (solver,)


def choose(
    solver: AbstractRoute | AutoRoute, n_source: int, n_weights: int, n_pixels: int
) -> AbstractRoute:
    """The route `solver` takes for a model of `n_source` source pixels."""
    if isinstance(solver, AutoRoute):
        return solver.choose(n_source, n_weights, n_pixels)
    return solver


def solves_on_host(solver: AbstractRoute | AutoRoute) -> bool:
    """Whether any route `solver` may take solves on the host (see `AbstractRoute.host`)."""
    return any(r.host for r in prepared(solver))
