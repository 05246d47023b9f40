"""`supported`: whether the Numba backend has a kernel or function for a class."""

from ._api import _load
from ._evidence import _MESHES, _REGULARIZATIONS
from ._registry import _BASIS, _INTENSITY, _MASS
from ._terms import _TERMS


def supported(cls: type) -> bool:
    """Whether the Numba backend can evaluate instances of exactly the class `cls` (a
    profile with a kernel, a source mesh, regularization or objective term with a
    registered function)."""
    _load()
    registries = (_MASS, _BASIS, _INTENSITY, _MESHES, _REGULARIZATIONS, _TERMS)
    return any(cls in r for r in registries)
