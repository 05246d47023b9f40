"""Enforces the abstract/final pattern (../shared/STYLE.md) over every equilens module class."""

import dataclasses
import inspect

import equinox as eqx
import pytest

import equilens as el
from equilens import light, mass, psf, regularization, source, terms

ROOTS = [
    mass.AbstractMassProfile,
    light.AbstractLightProfile,
    psf.AbstractPSF,
    terms.AbstractTerm,
    source.AbstractMesh,
    source.AbstractGeometry,
    regularization.AbstractRegularization,
]

# Concrete methods (and properties) of abstract classes that a final class may replace by an
# analytic form (hessian, convergence), a sparse one (a regularization's H by its entries;
# the default has none), or a term's own answer (a multi-band term is least squares when
# all of its bands are).
OVERRIDE_ALLOWLIST = {"hessian", "convergence", "sparse_matrix", "least_squares"}


def _all_subclasses(cls):
    out = set()
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("equilens"):
            out.add(sub)
        out |= _all_subclasses(sub)
    return out


CLASSES = sorted(
    {c for root in ROOTS for c in _all_subclasses(root)} | set(ROOTS), key=lambda c: c.__name__
)


def _is_abstract(cls) -> bool:
    return cls.__name__.startswith("Abstract")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_abstract_or_final(cls):
    if _is_abstract(cls):
        # abstract classes hold no fields (AbstractVar declarations are not fields)
        own = [f.name for f in dataclasses.fields(cls)]
        assert own == [], f"abstract {cls.__name__} declares fields {own}"
        return
    # final: nobody subclasses it, it has no abstract method left, and it inherits only from
    # abstract classes
    subs = [s for s in cls.__subclasses__() if s.__module__.startswith("equilens")]
    assert subs == [], f"final class {cls.__name__} is subclassed by {subs}"
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves abstract methods unimplemented"
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("equilens"):
            assert _is_abstract(base), f"{cls.__name__} inherits from final {base.__name__}"


@pytest.mark.parametrize(
    "cls", [c for c in CLASSES if not _is_abstract(c)], ids=lambda c: c.__name__
)
def test_final_classes_override_only_allowlisted_concrete_methods(cls):
    for name, value in vars(cls).items():
        if not (callable(value) or isinstance(value, property)) or name.startswith("__"):
            continue
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("equilens") or name not in vars(base):
                continue
            inherited = vars(base)[name]
            if getattr(inherited, "__isabstractmethod__", False):
                continue
            assert name in OVERRIDE_ALLOWLIST, (
                f"{cls.__name__}.{name} overrides the concrete {base.__name__}.{name}"
            )


def test_no_super_calls_or_hasattr_in_library():
    import pathlib

    src = pathlib.Path(el.__file__).parent
    for path in src.rglob("*.py"):
        text = path.read_text()
        assert "super()" not in text, f"super() in {path}"
        assert "hasattr(" not in text, f"hasattr in {path}"


def test_modules_are_equinox_modules():
    for cls in CLASSES:
        assert issubclass(cls, eqx.Module)


def test_numba_code_lives_only_in_the_numba_subpackage():
    import pathlib

    src = pathlib.Path(el.__file__).parent
    for path in src.rglob("*.py"):
        if path.parent.name == "numba" and path.parent.parent == src:
            continue
        text = path.read_text()
        for needle in ("njit", "numba.jit", "@jit", "prange"):
            assert needle not in text, f"{needle} in {path} (Numba code belongs in equilens/numba)"


def test_plot_and_numba_need_no_import_of_their_own():
    import subprocess
    import sys

    code = (
        "import sys, equilens as el\n"
        "assert 'equilens.plot' not in sys.modules  # imported on first use only\n"
        "print(el.plot.plot_fit.__name__, el.numba.log_density.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["plot_fit", "log_density"]
