"""The "sparse" route of the inversion (`SparseRoute`): `F = C^T C` and `E = C^T V` with
`C = W^(1/2) B M`, computed tile by tile on the host CPU by Numba kernels (a JAX
host callback, `equilens._callback.host_callback`, with a custom vector-Jacobian product).

The image is cut into `T x T` tiles. For one tile, the rows of `C` (its mask pixels) are
lit only by the mapped pixels within a PSF half-width of it, which map to a small set `S`
of source pixels: the block `C[tile, S]` is built densely (one axpy of a tabulated PSF
column, over the span of its non-zero tile positions, per interpolation weight), then
`F[S, S] += C_t C_t^T` (BLAS `syrk`, into `F`'s upper triangle, mirrored once at the end)
and `E[S] += C_t V_t`. The cost is
`O(n_mask ((T + 2h)^2 k + |S|^2))`: it never touches the `n_mask x n_source` product of
the "dense" route nor the `(2K-1)^2` neighbours per pixel of the "w_tilde" route. The
backward pass takes each block from the forward call (the whole system's host solve keeps
them, about `8 T^2 sum |S|` bytes, 9 MiB for the benchmark's 32x32 mesh) or builds it
again, and forms `dC = (Fbar + Fbar^T)[S, S] C + Ebar V^T` (BLAS `symm` on the small
block's upper triangle), then `wbar[p, i] = <dC[a_pi], psf column>` and
`Vbar = C^T Ebar`.

Tiles are split into one chunk per Numba thread, each chunk with its own accumulator
(`numba.set_num_threads` or `NUMBA_NUM_THREADS` sets how many cores are used); BLAS runs
single-threaded inside the kernels (threadpoolctl), the threads being Numba's.
"""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Scalar

from .._callback import host_callback
from ..inversion import (
    AbstractRoute,
    LinearProblem,
    RouteData,
    Solution,
    Solved,
    register_route,
)
from ..source._geometry import SparseSymmetric
from ._host_linalg import host_cholesky_solve, host_entries_logdet, sparse_system_solve
from ._runtime import host64, numba_available, run_kernel
from ._sparse_tables import SparseTables, sparse_tables, table_arrays


def _callback(name: str, shapes, *operands, extra: tuple = ()):
    """Runs kernel `name` on the host: `kernel(n_threads, *extra, *operands)` with integer
    operands as int64 and floating ones as float64; outputs in the dtype of `shapes`."""

    def host(*arrays):
        out = run_kernel(name, *extra, *host64(*arrays))
        return tuple(o.astype(s.dtype, copy=False) for o, s in zip(out, shapes, strict=True))

    arrays = (*operands[:-1], *table_arrays(operands[-1]))
    return host_callback(host, shapes, *arrays, vmap_method="sequential")


def _forward(idx, w, values, inv_sigma, n_s, tables):
    shapes = (
        jax.ShapeDtypeStruct((n_s, n_s), w.dtype),
        jax.ShapeDtypeStruct((n_s, values.shape[1]), w.dtype),
    )
    return _callback("forward", shapes, idx, w, values, inv_sigma, tables, extra=(n_s,))


@eqx.filter_custom_vjp
def _sparse_gram(diff, idx, inv_sigma, n_s, tables):
    w, values = diff
    return _forward(idx, w, values, inv_sigma, n_s, tables)


@_sparse_gram.def_fwd
def _sparse_gram_fwd(perturbed, diff, idx, inv_sigma, n_s, tables):
    del perturbed
    w, values = diff
    return _forward(idx, w, values, inv_sigma, n_s, tables), None


@_sparse_gram.def_bwd
def _sparse_gram_bwd(residuals, g, perturbed, diff, idx, inv_sigma, n_s, tables):
    del residuals, perturbed
    w, values = diff
    f_bar, e_bar = g
    # a symbolic-zero cotangent arrives as None (or a scalar): materialise it
    f_bar = jnp.broadcast_to(0.0 if f_bar is None else f_bar, (n_s, n_s)).astype(w.dtype)
    e_bar = jnp.broadcast_to(0.0 if e_bar is None else e_bar, (n_s, values.shape[1]))
    shapes = (jax.ShapeDtypeStruct(w.shape, w.dtype), jax.ShapeDtypeStruct(values.shape, w.dtype))
    return _callback(
        "backward",
        shapes,
        idx,
        w,
        values,
        inv_sigma,
        f_bar,
        e_bar.astype(w.dtype),
        tables,
    )


def sparse_gram(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    values: Float[Array, "n m"],
    inv_sigma: Float[Array, " n"],
    n_source: int,
    tables: SparseTables,
) -> tuple[Float[Array, "n_source n_source"], Float[Array, "n_source m"]]:
    """`F = C^T C` and `E = C^T V` with `C = W^(1/2) B M` (`n` mask pixels x `n_source`),
    for the interpolation `idx`, `w` over the mapped pixels and `V = values` on the mask
    pixels; differentiable (reverse mode) in `w` and `values`, not in the noise or the
    PSF (data). Runs on the host CPU (Numba)."""
    fixed = jax.lax.stop_gradient((inv_sigma, tables))
    return _sparse_gram((w, values), idx, fixed[0], n_source, fixed[1])


@register_route
class SparseRoute(AbstractRoute):
    """The "sparse" route (the CPU default): `F`, `D` and `E_L` from the tiled Numba
    kernels (`sparse_gram`), and the whole system assembled, factored on its envelope and
    solved in one host call (`sparse_system_solve`, which also gives `chi2 + s^T H s` in
    float64 without the model image). With `errors`, or non-negative source values, the
    curvature matrix comes back to JAX: a host Cholesky (`host_cholesky_solve`) for the
    non-negative solve, JAX's for the errors (whose factor is then differentiable, as on
    the other routes). Reverse-mode derivatives only (`host`): `LogEvidence` takes forward
    mode and Hessians through the "dense" route, the same function in pure JAX."""

    tables: SparseTables
    name: ClassVar[str] = "sparse"
    host: ClassVar[bool] = True

    @classmethod
    def available(cls) -> bool:
        return numba_available()

    @classmethod
    def prepare(cls, data: RouteData) -> "SparseRoute":
        shape = data.weight.shape
        return cls(sparse_tables(data.kernel, shape, data.pixels, data.mapped))

    def cost(self, n_source: int, n_weights: int, n_pixels: int) -> float:
        del n_source, n_weights, n_pixels
        return math.inf

    def entries_logdet(self, h: SparseSymmetric) -> Scalar:
        """On the host, on the envelope of `h`'s pattern (`host_entries_logdet`)."""
        return host_entries_logdet(h)

    def solve(self, problem: LinearProblem, errors: bool) -> Solved:
        p = problem
        values = jnp.concatenate([p.target[:, None], p.light.T], axis=1)
        if errors or p.positive is not None:
            curvature, projected = sparse_gram(
                p.idx, p.w, values, p.inv_sigma, p.n_source, self.tables
            )
            cholesky = None if errors else host_cholesky_solve
            return p.solve(curvature, projected[:, 0], projected[:, 1:], cholesky=cholesky)
        light = p.light
        x, logdet, fit = sparse_system_solve(
            p.idx,
            p.w,
            values,
            p.inv_sigma,
            p.regularization,
            light @ light.T,
            light @ p.target,
            self.tables,
            fixed_sparsity=p.fixed_sparsity,
        )
        solution = Solution(x=x, log_det_curvature=logdet, factor=None, scale=jnp.ones_like(x))
        block = None
        if p.profiled:
            empty = jnp.zeros((0, 0), p.w.dtype)
            block = sparse_system_solve(
                p.idx,
                p.w,
                values[:, :1],
                p.inv_sigma,
                p.regularization,
                empty,
                jnp.zeros((0,), p.w.dtype),
                self.tables,
                fixed_sparsity=p.fixed_sparsity,
            )[1]
        return Solved(solution=solution, fit=fit, block_log_det=block)
