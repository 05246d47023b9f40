"""Enforces the abstract/final pattern (../shared/STYLE.md) over every equilens module class."""

import dataclasses
import inspect

import equinox as eqx
import pytest

import equilens as el
from equilens import inversion, light, mass, psf, regularization, source, terms

ROOTS = [
    mass.AbstractMassProfile,
    light.AbstractLightProfile,
    psf.AbstractPSF,
    terms.AbstractTerm,
    source.AbstractMesh,
    source.AbstractGeometry,
    regularization.AbstractRegularization,
    inversion.AbstractRoute,
]

# Concrete methods (and properties) of abstract classes that a final class may replace by an
# analytic form (hessian, convergence), a sparse one (a regularization's H by its entries;
# the default has none), or an instance's own answer (a multi-band term is least squares
# when all of its bands are; an adaptive mesh uses the brightness when it has a weight floor;
# a route with its own factorisation of a regularization's entries, `entries_logdet`: the
# default has none).
OVERRIDE_ALLOWLIST = {
    "hessian",
    "convergence",
    "sparse_matrix",
    "least_squares",
    "uses_signal",
    "entries_logdet",
}


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


#: Public classes that are not Equinox modules, by design: host-side records of a fit's
#: diagnostics (frozen dataclasses of Python numbers and NumPy arrays, never traced) and
#: the status enumeration (optimistix's), and a parameter's domain (an interval, a
#: NamedTuple of Python numbers).
NOT_MODULES = {
    "ArcResiduals",
    "LightMoments",
    "MaskGrowth",
    "Search",
    "SubhaloScan",
    "SubhaloEvidence",
    "RESULTS",
    "Domain",
}


def test_public_classes_are_equinox_modules():
    # every class a user reaches from the public packages (not only the profile, term and
    # mesh hierarchies, which are modules by construction), exceptions and warnings aside
    from equilens import data, objective, solve

    found = {}
    for pkg in (
        el,
        mass,
        light,
        psf,
        regularization,
        source,
        terms,
        data,
        objective,
        solve,
        inversion,
        el.subhalo,
    ):
        for name in dir(pkg):
            obj = getattr(pkg, name)
            if name.startswith("_") or not inspect.isclass(obj):
                continue
            if obj.__module__.startswith("equilens") and not issubclass(obj, BaseException):
                found[name] = obj
    assert len(found) > 50 and set(NOT_MODULES) <= set(found)
    bad = sorted(n for n, c in found.items() if not issubclass(c, eqx.Module))
    assert bad == sorted(NOT_MODULES), f"public classes that are not eqx.Module: {bad}"


def test_numba_code_lives_only_in_the_numba_subpackage():
    import pathlib

    src = pathlib.Path(el.__file__).parent
    for path in src.rglob("*.py"):
        if path.parent.name == "numba" and path.parent.parent == src:
            continue
        text = path.read_text()
        for needle in ("njit", "numba.jit", "@jit", "prange"):
            assert needle not in text, f"{needle} in {path} (Numba code belongs in equilens/numba)"


@pytest.mark.precision_independent  # (which modules an import brings in)
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


#: Import cycles left (none): a new cycle fails.
KNOWN_CYCLES: list[list[str]] = []


def _imports(path, module: str, is_package: bool) -> set[str]:
    """The equilens modules `module` imports, at its top or inside functions (not in an
    `if TYPE_CHECKING:` block)."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("equilens")}


def test_no_import_cycles_but_the_known_ones():
    import pathlib

    root = pathlib.Path(el.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    graph = {
        m: {d for d in _imports(p, m, pkg) if d in modules and d != m}
        for m, (p, pkg) in modules.items()
    }
    # strongly connected components (Tarjan), ignoring a package's own __init__ (which
    # imports its submodules to re-export them: every submodule importing a sibling
    # through the package would otherwise close a loop)
    for m, (_, pkg) in modules.items():
        if pkg:
            graph[m] = set()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert sorted(cycles) == sorted(KNOWN_CYCLES)


def test_no_source_file_over_700_lines():
    # files of one concept (issue 48): a module that grows past this is doing several jobs
    import pathlib

    root = pathlib.Path(el.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 50
    assert {f: n for f, n in sizes.items() if n > 700} == {}


def test_neither_backend_imports_a_private_name_of_the_other():
    # a formula both backends need lives under a public name (issue 48): a change on one
    # side then shows where the other uses it
    import ast
    import pathlib

    root = pathlib.Path(el.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if package else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("equilens"):
                continue
            if target.startswith("equilens.numba") != module.startswith("equilens.numba"):
                bad += [f"{module} <- {target}.{a.name}" for a in node.names if a.name[0] == "_"]
    assert bad == []
