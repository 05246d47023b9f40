"""The linear algebra of a pixelized-source inversion (arrays only): the solve of
`(F + H) x = D` by Cholesky after a Jacobi scaling (optionally with non-negative source
values), the log determinants and their cheap derivatives (the formulas the Numba
backend shares are in `_formulas`).
"""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Bool, Float, Scalar

from ._formulas import jacobi_scaling, projected_gradient


def _fori_loop(n, body, init):
    return jax.lax.fori_loop(0, n, body, init)


class Solution(eqx.Module):
    """The solved linear system `(F + H) x = D` and the evidence's determinant terms."""

    x: Float[Array, " n"]
    log_det_curvature: Scalar
    factor: Float[Array, "n n"] | None
    scale: Float[Array, " n"]

    def inverse_diagonal(self) -> Float[Array, " n"]:
        """`diag((F + H)^-1)`: the variances of the solved values (Gaussian posterior).
        Needs the factor (a solve without a route's own `cholesky`)."""
        if self.factor is None:
            raise ValueError("the errors need the Cholesky factor: solve without `cholesky`")
        inv = inverse_from_factor(self.factor, lower=False)
        return jnp.diagonal(inv) * self.scale**2


def inverse_from_factor(factor: Float[Array, "n n"], lower: bool) -> Float[Array, "n n"]:
    """`a^-1` from the Cholesky factor of `a` (`a = L L^T` or `U^T U`): one triangular
    solve against the identity and one product."""
    n = factor.shape[0]
    eye = jnp.eye(n, dtype=factor.dtype)
    inv = jax.scipy.linalg.solve_triangular(factor, eye, lower=lower)
    return inv.T @ inv if lower else inv @ inv.T


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def logdet_factor(a: Float[Array, "n n"], factor: Float[Array, "n n"], lower: bool) -> Scalar:
    """`log det a` from its Cholesky `factor` (`lower` or upper): the derivative is taken
    with respect to `a` only (`d log det a = tr(a^-1 da)`, with `a^-1` from the factor:
    one triangular solve and one product, several times cheaper than differentiating
    through the factorisation); the factor's own tangent is ignored."""
    del a
    return 2.0 * jnp.sum(jnp.log(jnp.diagonal(factor)))


@logdet_factor.defjvp
def _logdet_factor_jvp(lower, primals, tangents):
    a, factor = primals
    a_dot, _ = tangents
    inv = inverse_from_factor(factor, lower)
    # A factor that failed (a not positive definite) gives a NaN log det, which callers
    # mask; its zero cotangent must not become NaN * 0.
    inv = jnp.where(jnp.isfinite(inv), inv, 0.0)
    return logdet_factor(a, factor, lower), jnp.sum(inv * a_dot)


def logdet_psd(matrix: Float[Array, "n n"]) -> Scalar:
    """`log det` of a symmetric positive-definite matrix by Cholesky (NaN if it is not).
    Its gradient, `a^-1`, comes from the factor (one triangular solve and one product:
    several times cheaper than differentiating through the factorisation)."""
    return logdet_factor(matrix, jnp.linalg.cholesky(matrix), True)


#: A Cholesky solve that runs elsewhere (e.g. LAPACK on the host): `(a, b) -> (x, log det
#: a)`, with `log det a` NaN when `a` is not positive definite.
HostCholesky = Callable[[Array, Array], tuple[Array, Array]]


def _cholesky(
    a: Float[Array, "n n"], b: Float[Array, " n"], cholesky: HostCholesky | None = None
) -> tuple[Array, Array | None, Array]:
    """Solves the positive-definite `a x = b` by Cholesky through lineax (or by
    `cholesky`); returns `x`, the upper factor (None with `cholesky`) and `log det a` (NaN
    when `a` is not positive definite)."""
    if cholesky is not None:
        x, logdet = cholesky(a, b)
        return x, None, logdet
    op = lx.MatrixLinearOperator(a, lx.positive_semidefinite_tag)
    solver = lx.Cholesky()
    state = solver.init(op, {})
    x = lx.linear_solve(op, b, solver, state=state, throw=False).value
    factor = state[0]
    return x, factor, logdet_factor(a, factor, False)


def solve_system(
    a: Float[Array, "n n"],
    b: Float[Array, " n"],
    nonnegative: Bool[Array, " n"] | None = None,
    cholesky: HostCholesky | None = None,
) -> Solution:
    """Solves `a x = b` (`a = F + H`, symmetric positive definite) after a symmetric Jacobi
    scaling. With `nonnegative` (a mask), those entries are constrained to be `>= 0`: an
    accelerated projected-gradient solve finds the active set, then the free entries are
    re-solved exactly (so the solution is differentiable on its active set). The log det
    is always that of the full `a`. With `cholesky` (a route's own factorisation, e.g.
    LAPACK on the host for the "sparse" route: it scales `a` itself), the factorisations
    are its, and the solution keeps no factor (no errors from it)."""
    if cholesky is not None and nonnegative is None:
        x, logdet = cholesky(a, b)
        return Solution(x=x, log_det_curvature=logdet, factor=None, scale=jnp.ones_like(b))
    a_s, b_s, scale = jacobi_scaling(jnp, a, b)
    x, factor, logdet = _cholesky(a_s, b_s, cholesky)
    if nonnegative is not None:
        x_pos = projected_gradient(jnp, a_s, b_s, nonnegative, _fori_loop)
        x_pos = jax.lax.stop_gradient(x_pos)
        free = (x_pos > 0) | ~nonnegative
        both = free[:, None] & free[None, :]
        eye = jnp.eye(a.shape[0], dtype=a.dtype)
        x, _, _ = _cholesky(jnp.where(both, a_s, eye), jnp.where(free, b_s, 0.0), cholesky)
    logdet = logdet - 2.0 * jnp.sum(jnp.log(scale))
    return Solution(x=x * scale, log_det_curvature=logdet, factor=factor, scale=scale)
