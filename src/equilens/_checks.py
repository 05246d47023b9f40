"""A parameter described once, and checked where it enters (construction).

Each parameter field declares what equilens needs to know about it next to the field, in
the metadata of its `eqx.field` (`metadata=describe(...)`):
- `domain`: where it is defined (a `Domain`); outside it the formulas give NaN or nonsense
  (a negative radius, an axis ratio past zero);
- `bounds`: the default interval a fit keeps it in (narrower than the domain: where a fit
  may search; `(0, inf)` is positivity);
- `fixed`: held by `equilens.fit` unless `free=` says otherwise (e.g. a shear's expansion
  point, degenerate with the source position), also for a field that is not a parameter
  at all (a mesh's nodes, a pixelized source's solved values).
`parameters(cls)` reads them all (one function for the checks, the fits and the Numba
backend).

`check_fields` runs in the profiles' `__check_init__`: every floating field must be
finite and inside its domain, a field annotated as a scalar must be 0-d (many profiles at
once: `MassBatch.stack`), and an ellipticity `(e1, e2)` must lie inside the unit disk.
With concrete values a violation is a `ValueError` naming the class, the field, the value
and the allowed range; with values traced under `jit` or `vmap`, `eqx.error_if` raises the
same words at run time.
"""

import dataclasses
import functools
import math
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from ._custom_types import FloatScalar


class Domain(NamedTuple):
    """An interval of allowed values: `lower` to `upper`, each end excluded when
    `lower_open` / `upper_open`. The default is the whole real line (finite values)."""

    lower: float = -math.inf
    upper: float = math.inf
    lower_open: bool = False
    upper_open: bool = False

    def contains(self, value: Any) -> Any:
        """Elementwise: `value` inside the interval (NumPy or JAX arrays)."""
        above = value > self.lower if self.lower_open else value >= self.lower
        below = value < self.upper if self.upper_open else value <= self.upper
        return above & below

    def __str__(self) -> str:
        left = "(" if self.lower_open or self.lower == -math.inf else "["
        right = ")" if self.upper_open or self.upper == math.inf else "]"
        return f"{left}{self.lower:g}, {self.upper:g}{right}"


#: `(0, inf)`: radii and scales (they divide).
POSITIVE = Domain(0.0, math.inf, lower_open=True)
#: `[0, inf)`: strengths that may be switched off.
NON_NEGATIVE = Domain(0.0, math.inf)


def is_traced(value: Any) -> bool:
    return isinstance(value, Tracer)


def _enforce(module: Any, field: str, ok: Any, message: str, shown: Any) -> None:
    """Raises `ValueError(message, got shown)` when a concrete `ok` is not all true; when
    `ok` is traced, puts an `eqx.error_if` on the field (the same words at run time)."""
    if is_traced(ok):
        # equinox sets converted fields the same way, while the module is being built
        checked = eqx.error_if(getattr(module, field), ~jnp.all(ok), message)
        object.__setattr__(module, field, checked)
    elif not np.all(ok):
        shown = np.asarray(shown)
        raise ValueError(f"{message}, got {shown.item() if shown.ndim == 0 else shown}")


class Parameter(NamedTuple):
    """What a field declares about itself (`describe(...)`): its `domain`, its default fit
    `bounds` (None: unbounded) and whether a fit holds it `fixed` by default."""

    domain: Domain = Domain()
    bounds: tuple[float, float] | None = None
    fixed: bool = False


_KEY = "equilens"
_UNDESCRIBED = Parameter()


def describe(
    *,
    domain: Domain | None = None,
    bounds: tuple[float, float] | None = None,
    fixed: bool = False,
) -> dict[str, Parameter]:
    """A parameter's description, as the `metadata` of its `eqx.field`:
    `theta_E: FloatScalar = eqx.field(converter=as_float, metadata=describe(
    domain=NON_NEGATIVE, bounds=(0.0, math.inf)))`. `domain` (a `Domain`, default the
    whole real line) is checked when the module is built; `bounds` (`(lower, upper)`) is
    the interval `equilens.fit` keeps it in by default; `fixed` holds it in fits unless
    `free=` picks it (also for a field that is not a parameter at all: a mesh's nodes, a
    pixelized source's solved values, a wrapped profile)."""
    if bounds is not None and not float(bounds[0]) < float(bounds[1]):
        raise ValueError(f"bounds must have lower < upper, got {bounds}")
    return {_KEY: Parameter(Domain() if domain is None else domain, bounds, bool(fixed))}


_OLD_TABLES = ("bounds", "domain", "fixed")


@functools.cache
def parameters(cls: type) -> dict[str, Parameter]:
    """`{field: Parameter}` for every field of module class `cls`, in declaration order
    (a field declared without a description gets the defaults: any finite value,
    unbounded, free). A class that still declares class-level `bounds`, `domain` or
    `fixed` tables (the form before `describe`) is an error rather than silently
    ignored."""
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    for table in _OLD_TABLES:
        if table in names:
            continue
        for base in cls.__mro__:
            if isinstance(vars(base).get(table), dict | tuple):
                raise TypeError(
                    f"{base.__name__}.{table} is a class-level table: declare each "
                    f"parameter's {table} next to its field, `name: FloatScalar = "
                    f"eqx.field(converter=as_float, metadata=equilens.describe({table}=...))`"
                )
    return {f.name: f.metadata.get(_KEY, _UNDESCRIBED) for f in fields}


def default_bounds(cls: type) -> dict[str, tuple[float, float]]:
    """`{field: (lower, upper)}` of the fields of `cls` that declare fit bounds."""
    return {n: p.bounds for n, p in parameters(cls).items() if p.bounds is not None}


def check_fields(module: Any) -> None:
    """Checks every floating field of `module` against its description (see
    the module's docstring). Called from the `__check_init__` of the base classes."""
    name = type(module).__name__
    described = parameters(type(module))
    fields = {f.name: f for f in dataclasses.fields(module)}
    for f in fields.values():
        value = getattr(module, f.name)
        if not eqx.is_inexact_array(value):
            continue
        if f.type is FloatScalar and value.ndim != 0:
            # (a mass profile, equilens's or a user's: the base class by name, as this
            # module cannot import `equilens.mass`)
            many = any(c.__name__ == "AbstractMassProfile" for c in type(module).__mro__)
            raise ValueError(
                f"{name}.{f.name} must be a scalar, got shape {value.shape}"
                + (
                    " (many profiles of one class at once: equilens.mass.MassBatch.stack)"
                    if many
                    else ""
                )
            )
        allowed = described[f.name].domain
        v = value if is_traced(value) else np.asarray(value)
        ok = allowed.contains(v) & (jnp.isfinite(v) if is_traced(v) else np.isfinite(v))
        _enforce(module, f.name, ok, f"{name}.{f.name} must be finite and in {allowed}", v)
    if "e1" in fields and "e2" in fields:
        e1, e2 = module.e1, module.e2
        traced = is_traced(e1) or is_traced(e2)
        e2sum = e1 * e1 + e2 * e2 if traced else np.asarray(e1) ** 2 + np.asarray(e2) ** 2
        message = (
            f"{name}: the ellipticity e = sqrt(e1^2 + e2^2) must be < 1 (axis ratio "
            "q = (1 - e) / (1 + e) > 0)"
        )
        _enforce(module, "e1", e2sum < 1, message, None if traced else np.sqrt(e2sum))


class PrecisionWarning(UserWarning):
    """JAX's x64 flag is off: equilens computes in float32 where float64 is meant."""


def warn_if_float32() -> None:
    """Warns (once per call site, Python's default) when JAX's default float is float32:
    equilens never sets the flag itself (that is the user's global choice), but says what
    it costs."""
    if jnp.result_type(float) == jnp.float32:
        warnings.warn(
            "JAX's x64 flag is off, so equilens computes in float32: about 1e-5 relative "
            "accuracy, too coarse for the power-law (EPL) series, evidences and covariances. "
            'Enable float64 first: jax.config.update("jax_enable_x64", True)',
            PrecisionWarning,
            stacklevel=2,
        )
