"""Forward-mode rules for scalars whose fast implementation differentiates in reverse mode
only (host kernels with a custom VJP, such as the sparse route of `LogEvidence`)."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree, Scalar


def _is_none(x) -> bool:
    return x is None


def _flat(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=_is_none)


def _perturbed(args: tuple, t_args: tuple) -> PyTree[bool]:
    """A filter of `args`: True at the floating arrays that have a tangent (the others'
    tangents are symbolic zeros, None)."""
    leaves, treedef = jax.tree.flatten(args, is_leaf=_is_none)
    t_leaves = _flat(t_args)
    return jax.tree.unflatten(
        treedef,
        [eqx.is_inexact_array(x) and t is not None for x, t in zip(leaves, t_leaves, strict=True)],
    )


@eqx.filter_custom_jvp
def _value_and_grad(fast, exact, wrt, *args):
    # `fast(*args)` and its gradient with respect to the arrays that `wrt` selects (None
    # elsewhere): one reverse pass, in which the others count as constants (so that the
    # host kernels' reverse-mode rules skip their cotangents)
    diff, static = eqx.partition(args, wrt)
    value, vjp = jax.vjp(lambda d: fast(*eqx.combine(d, static)), diff)
    (grads,) = vjp(jnp.ones_like(value))
    return value, grads


@_value_and_grad.def_jvp
def _value_and_grad_jvp(primals, tangents):
    # Second derivatives (Hessian-vector products) go through `exact`, a pure-JAX
    # implementation of the same function, in every direction that has a tangent.
    fast, exact, wrt, *rest = primals
    args = tuple(rest)
    _, _, _, *t_args = tangents
    value, grads = _value_and_grad(fast, exact, wrt, *args)
    diff, static = eqx.partition(args, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(diff, is_leaf=_is_none)
    t_diff = jax.tree.unflatten(
        treedef,
        [
            None if x is None else (jnp.zeros_like(x) if t is None else t)
            for x, t in zip(leaves, _flat(t_args), strict=True)
        ],
    )

    def exact_value_and_grad(d):
        inner, outer = eqx.partition(eqx.combine(d, static), wrt)
        return jax.value_and_grad(lambda dd: exact(*eqx.combine(dd, outer)))(inner)

    _, (value_dot, hvp) = jax.jvp(exact_value_and_grad, (diff,), (t_diff,))
    return (value, grads), (value_dot, hvp)


def _inner(grads, t_args, like) -> Scalar:
    out = jnp.zeros_like(like)
    for g, t in zip(_flat(grads), _flat(t_args), strict=True):
        if g is not None and t is not None:
            out = out + jnp.sum(g * t)
    return out


@eqx.filter_custom_jvp
def _scalar(fast, exact, *args):
    return fast(*args)


@_scalar.def_jvp
def _scalar_jvp(primals, tangents):
    fast, exact, *args = primals
    _, _, *t_args = tangents
    wrt = _perturbed(tuple(args), tuple(t_args))
    value, grads = _value_and_grad(fast, exact, wrt, *args)
    return value, _inner(grads, t_args, value)


def reverse_mode_scalar(fast: Callable, exact: Callable, *args) -> Scalar:
    """`fast(*args)`, a scalar, made differentiable in every mode although `fast` has
    reverse-mode rules only: a directional derivative is `<grad fast, tangent>` (one
    forward and one backward pass of `fast`, in which only the arrays that have a tangent
    are differentiated, so `jax.linearize`, `jax.jvp` and the optimistix minimisers
    work), and second derivatives come from `exact`, a pure-JAX implementation of the same
    function (used only for Hessians)."""
    return _scalar(fast, exact, *args)
