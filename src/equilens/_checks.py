"""The values a module's parameters may take, checked where they enter (construction).

A profile's `domain` (`{field: Domain}`) says where each parameter is defined: outside it
the formulas give NaN or nonsense (a negative radius, an axis ratio past zero). This is
not the fit's `bounds` (narrower: where a fit may search). `check_fields` runs in the
profiles' `__check_init__`: every floating field must be finite and inside its domain, a
field annotated as a scalar must be 0-d (many profiles at once: `MassBatch.stack`), and an
ellipticity `(e1, e2)` must lie inside the unit disk. With concrete values a violation is a
`ValueError` naming the class, the field, the value and the allowed range; with values
traced under `jit` or `vmap`, `eqx.error_if` raises the same words at run time.
"""

import dataclasses
import math
import warnings
from collections.abc import Mapping
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


def check_fields(module: Any, domain: Mapping[str, Domain]) -> None:
    """Checks every floating field of `module` (see the module's docstring). Called from
    the `__check_init__` of the profile base classes with the class's `domain`."""
    name = type(module).__name__
    fields = {f.name: f for f in dataclasses.fields(module)}
    unknown = set(domain) - set(fields)
    if unknown:  # a typo in a class's declaration
        raise TypeError(f"{name}.domain names no field: {sorted(unknown)}")
    for f in fields.values():
        value = getattr(module, f.name)
        if not eqx.is_inexact_array(value):
            continue
        if f.type is FloatScalar and value.ndim != 0:
            many = type(module).__module__.startswith("equilens.mass")
            raise ValueError(
                f"{name}.{f.name} must be a scalar, got shape {value.shape}"
                + (
                    " (many profiles of one class at once: equilens.mass.MassBatch.stack)"
                    if many
                    else ""
                )
            )
        allowed = domain.get(f.name, Domain())
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
