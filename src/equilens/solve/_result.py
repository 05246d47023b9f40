"""Fit results and their status codes."""

from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optimistix as optx
from jaxtyping import Array, Float, Int, PyTree

if TYPE_CHECKING:
    from ._residuals import ArcResiduals


class RESULTS(optx.RESULTS):  # pyright: ignore[reportGeneralTypeIssues]
    """Outcome of a fit: optimistix's codes plus the fit's own."""

    covariance_failed = (
        "The Hessian at the optimum is not positive definite: no covariance (the fit may "
        "not be at a minimum, or a parameter is unconstrained by the data)."
    )
    implausible = (
        "The fit converged to an implausible model (a parameter at a bound, a source larger "
        "than the data, or an Einstein radius beyond the data): a local minimum; see `notes`."
    )
    ambiguous = (
        "Other minima fit the data as well (objectives within a few units) with another "
        "Einstein radius: the data do not decide between them; see `notes`."
    )


# optimistix's `successful` has an empty message, so a result printed as `RESULTS<>`: this
# class's own table of messages (each enumeration has its own) says it in words
RESULTS._index_to_message[int(RESULTS.successful._value)] = "successful"  # pyright: ignore[reportAttributeAccessIssue]


class FitResult(eqx.Module):
    """The outcome of `equilens.fit`.

    **Fields:**

    - `model`: the best-fit model (linear amplitudes filled in).
    - `value`: the objective at `model` (negative log posterior, natural units).
    - `term_values`: each term's (unweighted) value.
    - `chi2`: chi2 of the imaging terms; `n_data` pixels, `n_free` fitted parameters and
      `n_linear` linearly solved amplitudes give `reduced_chi2 = chi2 / (n_data - n_free -
      n_linear)`.
    - `num_steps`: solver steps taken; `result`: a `RESULTS` code (`RESULTS.successful`, or
      why not).
    - `covariance`: covariance of the free parameters (Laplace approximation: the inverse
      Hessian of the objective at the optimum, in physical units; for least-squares
      objectives the Gauss-Newton Hessian `J^T J`), ordered as `names`. With linear
      amplitudes solved inside the objective this is the covariance marginalised over them.
    - `names`: path of every free scalar parameter, e.g. `mass.components[0].theta_E`.
    - `solver`: the solver's name; `wall_time`: seconds (host clock, compile included; an
      array, like the other statistics, so that results of one fit `jax.tree.map`
      together and pass through `jit` without compiling again).
    - `notes`: why the model is implausible (`equilens.solve.implausible_notes`; the
      status is then `RESULTS.implausible`), or how the errors were obtained when not from
      the Hessian over every fitted parameter (`equilens.solve.with_conditional_covariance`);
      empty otherwise.
    - `arc_residuals`: for the lens pipelines' results (`fit_lens`, `fit_pixelized`, and
      the multi-band ones: the worst band), the residuals over the arcs against the noise
      level elsewhere (`equilens.solve.ArcResiduals`); None otherwise.

    Batched fits (`fit_batch`, `multi_start`) give the array fields a leading batch axis;
    `equilens.solve.pick(result, i)` takes one element.
    """

    model: PyTree[Any]
    value: Float[Array, "*batch"]
    term_values: Float[Array, "*batch n_terms"]
    chi2: Float[Array, "*batch"]
    num_steps: Int[Array, "*batch"]
    result: RESULTS
    covariance: Float[Array, "*batch n n"]
    names: tuple[str, ...] = eqx.field(static=True)
    n_data: int = eqx.field(static=True)
    n_linear: int = eqx.field(static=True)
    solver: str = eqx.field(static=True)
    wall_time: Float[Array, "*batch"] = eqx.field(converter=jnp.asarray, default=float("nan"))
    notes: tuple[str, ...] = eqx.field(static=True, default=())
    arc_residuals: "ArcResiduals | None" = eqx.field(static=True, default=None)

    @property
    def n_free(self) -> int:
        return len(self.names)

    @property
    def reduced_chi2(self) -> Float[Array, "*batch"]:
        dof = max(self.n_data - self.n_free - self.n_linear, 1)
        return self.chi2 / dof

    @property
    def errors(self) -> Float[Array, "*batch n"]:
        """1-sigma errors of the free parameters (square root of the covariance diagonal)."""
        return jnp.sqrt(jnp.diagonal(self.covariance, axis1=-2, axis2=-1))

    @property
    def values(self) -> Float[Array, " n"]:
        """Best-fit values of the free parameters, ordered as `names`."""
        import jax.tree_util as jtu

        leaves = dict(
            (jtu.keystr(p).lstrip("."), leaf)
            for p, leaf in jtu.tree_flatten_with_path(self.model)[0]
        )
        out = []
        for name in self.names:
            if name in leaves:
                out.append(jnp.reshape(leaves[name], ()))
            else:
                base, idx = name.rsplit("[", 1)
                out.append(jnp.reshape(leaves[base], (-1,))[int(idx[:-1])])
        return jnp.stack(out)

    @property
    def success(self) -> bool:
        return bool(np.all(np.asarray(self.result._value) == RESULTS.successful._value))  # pyright: ignore

    def message(self) -> str:
        """The status in words (with the `notes`, if any)."""
        out = RESULTS[self.result]
        if self.notes:
            short = out
            if self.result == RESULTS.implausible:
                short = "implausible"
            elif self.result == RESULTS.ambiguous:
                short = "ambiguous"
            out = f"{short}: {'; '.join(self.notes)}"
        return out

    def table(self) -> str:
        """The free parameters with their 1-sigma errors, one per line."""
        width = max(len(n) for n in self.names) if self.names else 10
        vals, errs = np.asarray(self.values), np.asarray(self.errors)
        lines = [f"{'parameter':<{width}}  {'value':>12}  {'1-sigma':>10}"]
        for n, v, e in zip(self.names, vals, errs, strict=True):
            lines.append(f"{n:<{width}}  {v:>12.6g}  {e:>10.3g}")
        lines.append(
            f"chi2 = {float(self.chi2):.1f} over {self.n_data} pixels, reduced chi2 = "
            f"{float(self.reduced_chi2):.4f}; {int(self.num_steps)} steps ({self.solver}), "
            f"{self.message()}"
        )
        return "\n".join(lines)
