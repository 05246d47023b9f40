"""Free parameters and bounds: a filter over the model pytree plus a reparametrisation.

A fit varies an unconstrained vector of "raw" values, one per free leaf of the model; at the
top of the objective each raw value is mapped into its interval (`lower + exp(raw)`,
`upper - exp(raw)` or `lower + (upper - lower) sigmoid(raw)`), so bounds such as
`theta_E > 0`, `-0.6 < e1 < 0.6` or `1.1 < gamma < 2.9` always hold. No parameter names are
kept by hand: leaves are found by walking the model, bounds come from each field's
description (`equilens.describe(bounds=...)`), `UniformPrior` terms, and the user's
`bounds={where: (lower, upper)}`.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float, PyTree

from .._checks import Parameter, is_traced, parameters

Bounds = tuple[float, float]
Where = Callable[[PyTree[Any]], Any]


def select(model: PyTree[Any], where: Where) -> PyTree[bool]:
    """A boolean pytree shaped like `model`: True at the leaves inside the node(s) that
    `where(model)` picks (as `eqx.tree_at`), e.g.
    `select(system, lambda s: (s.mass, s.source.center_x))` frees the mass model and the
    source's x position. Inside a picked module, the fields its class lists in `fixed`
    (e.g. `ExternalShear.ra_0`) stay False unless `where` picks them directly. Combine
    masks with `jax.tree.map(operator.or_, a, b)`. Everything inside a field a class lists in
    `fixed` (e.g. the profile of a `FixedLight`) stays False too."""
    mask = jtu.tree_map(lambda _: False, model)

    def mark(node: Any) -> Any:
        if isinstance(node, bool):  # a leaf picked directly
            return True
        flags = [not _held(node, path) for path, _ in jtu.tree_flatten_with_path(node)[0]]
        return jtu.tree_unflatten(jtu.tree_structure(node), flags)

    return eqx.tree_at(where, mask, replace_fn=mark)


def _child(node: Any, key: Any) -> Any:
    """The child of `node` under one key of a pytree path (`KeyError` for other keys)."""
    if isinstance(key, jtu.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jtu.SequenceKey):
        return node[key.idx]
    if isinstance(key, jtu.DictKey):
        return node[key.key]
    raise KeyError(key)


def _described(node: Any, name: str) -> Parameter:
    """What the field `name` of `node` declares (`equilens.describe`): nothing for a
    node that is not a module."""
    if isinstance(node, eqx.Module):
        return parameters(type(node)).get(name, Parameter())
    return Parameter()


def _held(model: PyTree[Any], path: tuple[Any, ...]) -> bool:
    """Whether a module on `path` declares the next field of the path `fixed` (e.g.
    `ExternalShear.ra_0`, or everything inside a `FixedLight`)."""
    node = model
    for key in path:
        if isinstance(key, jtu.GetAttrKey) and _described(node, key.name).fixed:
            return True
        try:
            node = _child(node, key)
        except KeyError:
            return False
    return False


def _owner_and_name(model: PyTree[Any], path: tuple[Any, ...]) -> tuple[Any, str | None]:
    node = model
    for key in path[:-1]:
        try:
            node = _child(node, key)
        except KeyError:
            return None, None
    if path and isinstance(path[-1], jtu.GetAttrKey):
        return node, path[-1].name
    return node, None


def _forward(raw: Array, bounds: Bounds | None) -> Array:
    if bounds is None:
        return raw
    lo, hi = bounds
    if math.isinf(lo) and math.isinf(hi):
        return raw
    if math.isinf(hi):
        return lo + jnp.exp(raw)
    if math.isinf(lo):
        return hi - jnp.exp(raw)
    return lo + (hi - lo) * jax.nn.sigmoid(raw)


def _log_abs_slope(raw: Array, bounds: Bounds | None) -> Array:
    """`log |d _forward(raw) / d raw|`, elementwise."""
    if bounds is None:
        return jnp.zeros_like(raw)
    lo, hi = bounds
    if math.isinf(lo) and math.isinf(hi):
        return jnp.zeros_like(raw)
    if math.isinf(lo) or math.isinf(hi):
        return raw
    return math.log(hi - lo) + jax.nn.log_sigmoid(raw) + jax.nn.log_sigmoid(-raw)


#: A starting value exactly at a finite bound (as a fit that ran onto it returns: the
#: bounded map reaches the bound in floating point) starts this fraction of the interval
#: (or of `max(1, |bound|)` for a one-sided interval) inside it; in float32, 4 ulps.
AT_BOUND_START = 1e-9


def _inside(value: Array, bounds: Bounds) -> Array:
    """`value` where it is strictly inside `bounds` (the bounded map inverts it, however
    close to a bound: near a bound the map is logarithmic in the distance to it, so a
    regularization coefficient of 1e-70 over (0, inf) is as good a start as 1); a value
    at (or, traced, beyond) a finite bound moved `AT_BOUND_START` inside it."""
    lo, hi = bounds
    value = jnp.asarray(value)
    frac = max(AT_BOUND_START, 4 * float(jnp.finfo(value.dtype).eps))
    if math.isinf(lo) or math.isinf(hi):
        b = hi if math.isinf(lo) else lo
        step = frac * max(1.0, abs(b))
        if math.isinf(lo):
            return jnp.where(value < hi, value, hi - step)
        return jnp.where(value > lo, value, lo + step)
    step = frac * (hi - lo)
    return jnp.where(value <= lo, lo + step, jnp.where(value >= hi, hi - step, value))


def _inverse(value: Array, bounds: Bounds | None) -> Array:
    if bounds is None:
        return value
    lo, hi = bounds
    if math.isinf(lo) and math.isinf(hi):
        return value
    value = _inside(value, bounds)
    if math.isinf(hi):
        return jnp.log(value - lo)
    if math.isinf(lo):
        return jnp.log(hi - value)
    return jnp.log(value - lo) - jnp.log(hi - value)


class Parametrisation(eqx.Module):
    """Which leaves of a model a fit varies, and the interval each is kept in.

    Build it with `Parametrisation.build(model, objective, free=..., bounds=...)`;
    `to_raw(model)` gives the unconstrained values of the free leaves (a tuple of arrays, the
    `y` a solver iterates on) and `to_model(raw, template)` puts them back into a model.
    `paths` names every free scalar (e.g. `.mass.components[0].theta_E`).
    """

    treedef: Any = eqx.field(static=True)
    free: tuple[bool, ...] = eqx.field(static=True)
    bounds: tuple[Bounds | None, ...] = eqx.field(static=True)
    leaf_paths: tuple[str, ...] = eqx.field(static=True)

    @classmethod
    def build(
        cls,
        model: PyTree[Any],
        linear: PyTree[bool] | None = None,
        *,
        free: PyTree[bool] | Callable[[Any], bool] | None = None,
        bounds: Mapping[Where, Bounds] | None = None,
        prior_bounds: Mapping[Where, Bounds] | None = None,
        check: bool = True,
    ) -> "Parametrisation":
        """**Arguments:**

        - `model`: the starting model.
        - `linear`: boolean pytree, True at leaves solved linearly inside the objective
          (never free).
        - `free`: None (every floating-point leaf except `linear` ones and the fields a
          class describes as `fixed`, e.g. a shear's `ra_0`), a boolean pytree
          shaped like `model` (see `select`), or a predicate on leaves.
        - `bounds`: `{where: (lower, upper)}` overriding the class defaults.
        - `prior_bounds`: bounds from uniform priors (used where `bounds` says nothing).
        - `check`: check that `model` is inside the bounds (see below).

        Leaves solved linearly are never free (the objective solves them at every
        evaluation; use `GaussianLikelihood(..., linear=False)` to fit them instead).
        Raises `ValueError` when a starting value is outside its bounds (naming the
        parameter and the interval).
        """
        path_leaves, treedef = jtu.tree_flatten_with_path(model)
        n = len(path_leaves)
        is_float = [eqx.is_inexact_array(leaf) for _, leaf in path_leaves]
        lin = [False] * n if linear is None else _as_list(model, linear)
        owners = [_owner_and_name(model, path) for path, _ in path_leaves]
        held = [_held(model, path) for path, _ in path_leaves]
        if free is None:
            fr = [f and not li and not h for f, li, h in zip(is_float, lin, held, strict=True)]
        else:
            if callable(free):
                spec = [bool(free(leaf)) for _, leaf in path_leaves]
            else:
                spec = _as_list(model, free)
            # amplitudes solved linearly are never free: the objective re-solves them
            fr = [s and f and not li for s, f, li in zip(spec, is_float, lin, strict=True)]
        bnd: list[Bounds | None] = []
        for owner, name in owners:
            bnd.append(_described(owner, name).bounds if name else None)
        for overrides in (prior_bounds, bounds):
            for where, b in (overrides or {}).items():
                mask = _as_list(model, select(model, where))
                lo, hi = float(b[0]), float(b[1])
                if not lo < hi:
                    raise ValueError(f"bounds must have lower < upper, got {b}")
                bnd = [(lo, hi) if m else old for m, old in zip(mask, bnd, strict=True)]
        paths = tuple(jtu.keystr(p) for p, _ in path_leaves)
        out = cls(treedef, tuple(fr), tuple(bnd), paths)
        if check:
            out.check(model)
        return out

    def check(self, model: PyTree[Any]) -> None:
        """Raises `ValueError` if a free leaf of `model` is outside its bounds (host-side).
        A value exactly at a bound is accepted: `to_raw` starts it `AT_BOUND_START` inside."""
        leaves = jtu.tree_leaves(model)
        for leaf, f, b, path in zip(leaves, self.free, self.bounds, self.leaf_paths, strict=True):
            if not f or b is None or is_traced(leaf):
                # (a traced start, inside a transformation, cannot be read: to_raw moves it
                # inside its bounds)
                continue
            v = np.asarray(leaf)
            if not np.isfinite(v).all():
                raise ValueError(f"{path.lstrip('.')} has non-finite starting values")
            if not (np.all(v >= b[0]) and np.all(v <= b[1])):
                raise ValueError(
                    f"starting value {path.lstrip('.')} = {v.tolist()} is outside its bounds "
                    f"({b[0]}, {b[1]}); pass bounds={{where: (lower, upper)}} to change them"
                )

    @property
    def n_free(self) -> int:
        return sum(self.free)

    def to_raw(self, model: PyTree[Any]) -> tuple[Float[Array, "..."], ...]:
        """The unconstrained values of the free leaves of `model`."""
        leaves = jtu.tree_leaves(model)
        return tuple(
            _inverse(leaf, b)
            for leaf, f, b in zip(leaves, self.free, self.bounds, strict=True)
            if f
        )

    def to_model(self, raw: tuple[Float[Array, "..."], ...], template: PyTree[Any]) -> PyTree[Any]:
        """`template` with its free leaves set from the unconstrained values `raw`."""
        leaves = jtu.tree_leaves(template)
        it = iter(raw)
        new = [
            _forward(next(it), b).astype(leaf.dtype) if f else leaf
            for leaf, f, b in zip(leaves, self.free, self.bounds, strict=True)
        ]
        return jtu.tree_unflatten(self.treedef, new)

    def log_jacobian(self, raw: tuple[Float[Array, "..."], ...]) -> Float[Array, ""]:
        """`log |det d values / d raw|` at the unconstrained values `raw`: what turns a
        density over the physical values into one over `raw` (the maps are elementwise,
        so the Jacobian is diagonal)."""
        bounds = [b for f, b in zip(self.free, self.bounds, strict=True) if f]
        terms = [jnp.sum(_log_abs_slope(r, b)) for r, b in zip(raw, bounds, strict=True)]
        return jnp.sum(jnp.stack(terms)) if terms else jnp.zeros(())

    def values(self, model: PyTree[Any]) -> tuple[Float[Array, "..."], ...]:
        """The physical values of the free leaves of `model`."""
        leaves = jtu.tree_leaves(model)
        return tuple(leaf for leaf, f in zip(leaves, self.free, strict=True) if f)

    def with_values(
        self, values: tuple[Float[Array, "..."], ...], template: PyTree[Any]
    ) -> PyTree[Any]:
        """`template` with its free leaves replaced by the physical `values`."""
        leaves = jtu.tree_leaves(template)
        it = iter(values)
        new = [next(it) if f else leaf for leaf, f in zip(leaves, self.free, strict=True)]
        return jtu.tree_unflatten(self.treedef, new)

    def paths(self, model: PyTree[Any]) -> tuple[str, ...]:
        """One name per free scalar: the leaf's path, with `[k]` for vector elements."""
        out = []
        leaves = jtu.tree_leaves(model)
        for leaf, f, p in zip(leaves, self.free, self.leaf_paths, strict=True):
            if not f:
                continue
            size = int(np.prod(np.shape(leaf)))
            name = p.lstrip(".")
            out.extend([name] if np.ndim(leaf) == 0 else [f"{name}[{i}]" for i in range(size)])
        return tuple(out)


def _as_list(model: PyTree[Any], mask: PyTree[bool]) -> list[bool]:
    """A boolean mask (a pytree shaped like `model`, or a prefix of it) as one flag per leaf."""
    full = jtu.tree_map(
        lambda m, sub: jtu.tree_map(lambda _: bool(m), sub),
        mask,
        model,
        is_leaf=lambda x: x is None,
    )
    flags = jtu.tree_leaves(full)
    n = len(jtu.tree_leaves(model))
    if len(flags) != n:
        raise ValueError(f"the mask has {len(flags)} leaves but the model has {n}")
    return flags


def linear_leaves(model: PyTree[Any], objective: Any) -> PyTree[bool] | None:
    """True at the leaves a fit never varies because the objective or the model sets them:
    the amplitudes the objective's imaging terms solve linearly, and the shape parameters a
    `MultiBandLensSystem` ties to band 0."""
    from .._lens_system import LensSystem
    from .._multiband import MultiBandLensSystem

    if isinstance(model, MultiBandLensSystem):
        mask = model.tied()
        if not objective.solves_linear():
            return mask
        for i in range(model.n_bands):
            for name in ("source", "lens_light"):
                if getattr(model, name) is None:
                    continue
                amps = _band_linear(model, name, i)
                mask = jtu.tree_map(lambda a, b: a or b, mask, amps)
        return mask
    if not objective.solves_linear() or not isinstance(model, LensSystem):
        return None
    comps = model.linear_components()
    if not comps:
        return None
    return select(model, lambda s: [c.amp for c in s.linear_profiles()])


def _band_linear(model: Any, name: str, i: int) -> PyTree[bool]:
    """True at the amplitudes of the linear light components of band `i`'s `name` field."""
    from .._lens_system import _light_components
    from ..light import AbstractLinearLightProfile

    profile = getattr(model, name)[i]
    picks = [c for c in _light_components(profile) if isinstance(c, AbstractLinearLightProfile)]
    if not picks:
        return jtu.tree_map(lambda _: False, model)

    def where(m):
        comps = _light_components(getattr(m, name)[i])
        return [c.amp for c in comps if isinstance(c, AbstractLinearLightProfile)]

    return select(model, where)


class ObjectiveFunctions(eqx.Module):
    """An objective as plain functions of unconstrained values, for calling optimistix or
    optax yourself: `value(y, args)` (scalar) and `residuals(y, args)` (whitened residuals,
    least-squares objectives only), with `y0` the start and `args = (objective, model)`.
    `model(y)` maps values back to the model (linear amplitudes not yet solved; use
    `objective.complete`). E.g. `optx.minimise(f.value, optx.BFGS(1e-6, 1e-6), f.y0, f.args)`.
    """

    parametrisation: Parametrisation
    y0: tuple[Float[Array, "..."], ...]
    args: tuple[Any, PyTree[Any]]

    def value(self, y: tuple[Float[Array, "..."], ...], args: tuple[Any, PyTree[Any]]) -> Any:
        objective, template = args
        return objective(self.parametrisation.to_model(y, template))

    def residuals(
        self, y: tuple[Float[Array, "..."], ...], args: tuple[Any, PyTree[Any]]
    ) -> Float[Array, " n"]:
        objective, template = args
        return objective.residuals(self.parametrisation.to_model(y, template))

    def model(self, y: tuple[Float[Array, "..."], ...]) -> PyTree[Any]:
        return self.parametrisation.to_model(y, self.args[1])


def functions(
    objective: Any,
    model: PyTree[Any],
    *,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
) -> ObjectiveFunctions:
    """`objective` over the free parameters of `model` (chosen and bounded as in
    `equilens.fit`) as `fn(y, args)` functions for optimistix and optax."""
    param = Parametrisation.build(model, linear_leaves(model, objective), free=free, bounds=bounds)
    return ObjectiveFunctions(param, param.to_raw(model), (objective, model))
