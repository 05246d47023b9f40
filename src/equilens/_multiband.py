"""A lens seen in several bands: one mass model, light per band or shared in shape."""

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._lens_system import LensSystem
from .light import AbstractLightProfile, AbstractLinearLightProfile, FixedLight, LightSum
from .mass import AbstractMassProfile
from .source import PixelizedSource

LightArg = AbstractLightProfile | Iterable[AbstractLightProfile] | None


def _band_fields(profile: AbstractLightProfile) -> tuple[str, ...]:
    """The fields of one light component that belong to a band even when its shape is shared
    by all bands: the amplitudes a linear solve fills in (`amp`), or a pixelized source's
    solved values and the mesh they live on (traced through that band's grid)."""
    if isinstance(profile, PixelizedSource):
        return ("values", "geometry")
    if isinstance(profile, AbstractLinearLightProfile):
        return ("amp",)
    return ()


def _replace(module: eqx.Module, changes: dict[str, Any]) -> Any:
    """`module` with some fields replaced, built as unflattening a pytree builds a module
    (no `__init__`, no converters: the leaves keep their types, NumPy arrays on the Numba
    backend included). `eqx.tree_at` does the same but costs ~100 us per call, which
    `band` pays for every shared field of every band at every evaluation."""
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(
            new, f.name, changes[f.name] if f.name in changes else getattr(module, f.name)
        )
    return new


def _tie(shape: PyTree, own: PyTree) -> PyTree:
    """`shape` (the shared profile, band 0's) with the band fields of `own` (one band's
    copy): what that band sees. Also applied to boolean masks of the same structure."""
    if isinstance(shape, LightSum):
        parts = tuple(_tie(a, b) for a, b in zip(shape.components, own.components, strict=True))
        return _replace(shape, {"components": parts})
    if isinstance(shape, FixedLight):  # held as it is: nothing a band solves
        return shape
    names = _band_fields(shape)
    if not names:
        return shape
    return _replace(shape, {n: getattr(own, n) for n in names})


def _per_band(name: str, value: LightArg, n: int) -> tuple[tuple | None, bool]:
    """`value` as one entry per band (`n` of them; a sequence's length is checked by the
    caller), and whether it was one profile shared by all bands."""
    if value is None:
        return None, False
    if isinstance(value, AbstractLightProfile):
        return (value,) * n, True
    out = tuple(value)
    for v in out:
        if not isinstance(v, AbstractLightProfile):
            raise TypeError(f"MultiBandLensSystem.{name} entries must be light profiles, got {v!r}")
    return out, False


def _light_of(model: "MultiBandLensSystem", name: str, i: int) -> Any:
    profiles = model.source if name == "source" else model.lens_light
    if profiles is None:
        return None
    if name in model.shared and i != 0:
        return _tie(profiles[0], profiles[i])
    return profiles[i]


def _band(model: "MultiBandLensSystem", i: int) -> LensSystem:
    # (built as a pytree is unflattened: `LensSystem` has no checks of its own, and its
    # constructor costs more than the band's Numba likelihood of a small image)
    template = object.__new__(LensSystem)
    return _replace(
        template,
        {
            "mass": model.mass,
            "source": _light_of(model, "source", i),
            "lens_light": _light_of(model, "lens_light", i),
        },
    )


class MultiBandLensSystem(eqx.Module):
    """One lens seen in several bands: a single `mass` model deflects every band; the lens
    light and the source are either one profile shared by all bands in shape (position,
    size, ellipticity, Sersic index; a pixelized source's mesh and regularization) with
    per-band amplitudes, or one profile per band (fully independent).

    `band(i)` is the `LensSystem` band `i` sees; a `equilens.MultiBandTerm` sums the
    per-band terms over them. The per-band parts of a shared profile are its amplitudes
    (`amp` of every profile linear in it: `Sersic`, `Gaussian`, `MGE`, `Shapelets`, ...;
    solved in each band by its term when the term is `linear`, else fitted per band) and a
    pixelized source's values and traced mesh (each band solves its own inversion with the
    shared mesh and regularization).

    Stored per band either way: `lens_light[i]`, `source[i]` hold band `i`'s profile. For a
    shared field (`shared` names it) band 0's copy holds the shape that every band uses; the
    other copies' shape parameters are tied to it (a fit never varies them and fills them
    in from band 0 when it completes the model), their amplitudes are their own.

    **Arguments:** `mass`; `source` and `lens_light` (None, one profile = shared, or a
    sequence of one profile per band); `bands` (the number of bands; needed when no field is
    given per band).
    """

    mass: AbstractMassProfile
    source: tuple[AbstractLightProfile, ...]
    lens_light: tuple[AbstractLightProfile, ...] | None
    shared: tuple[str, ...] = eqx.field(static=True)

    def __init__(
        self,
        mass: AbstractMassProfile,
        source: LightArg,
        lens_light: LightArg = None,
        *,
        bands: int | None = None,
        shared: Sequence[str] | None = None,
    ):
        if not isinstance(mass, AbstractMassProfile):
            raise TypeError(f"MultiBandLensSystem.mass must be a mass profile, got {type(mass)}")
        if source is None:
            raise TypeError("MultiBandLensSystem needs a source")
        n = None if bands is None else int(bands)
        # (a sequence, or any iterable, of per-band profiles: read once)
        if source is not None and not isinstance(source, AbstractLightProfile):
            source = tuple(source)
        if lens_light is not None and not isinstance(lens_light, AbstractLightProfile):
            lens_light = tuple(lens_light)
        for name, value in (("source", source), ("lens_light", lens_light)):
            if isinstance(value, tuple):
                count = len(value)
                if n is not None and count != n:
                    raise ValueError(
                        f"MultiBandLensSystem.{name} has {count} entries for {n} bands"
                    )
                n = count
        if n is None:
            raise ValueError(
                "MultiBandLensSystem: give bands=N, or the source or lens light per band"
            )
        if n < 1:
            raise ValueError(f"MultiBandLensSystem needs bands >= 1, got {n}")
        src, src_shared = _per_band("source", source, n)
        light, light_shared = _per_band("lens_light", lens_light, n)
        assert src is not None
        if shared is None:
            names = tuple(k for k, s in (("source", src_shared), ("lens_light", light_shared)) if s)
        else:
            names = tuple(shared)
            for k in names:
                if k not in ("source", "lens_light"):
                    raise ValueError(f"shared names 'source' and/or 'lens_light', got {k!r}")
            if "lens_light" in names and light is None:
                raise ValueError("shared names 'lens_light' but there is no lens light")
        for k in names:
            profiles = src if k == "source" else light
            assert profiles is not None
            kinds = {jtu.tree_structure(p) for p in profiles}
            if len(kinds) > 1:
                raise ValueError(
                    f"a shared {k} needs the same profile (same structure) in every band"
                )
        self.mass = mass
        self.source = src
        self.lens_light = light
        self.shared = names

    @property
    def n_bands(self) -> int:
        return len(self.source)

    def band(self, i: int) -> LensSystem:
        """The `LensSystem` of band `i`: the mass model, and the band's lens light and source
        (shared shapes taken from band 0, amplitudes from band `i`)."""
        if not 0 <= i < self.n_bands:
            raise IndexError(f"band {i} of a {self.n_bands}-band system")
        return _band(self, i)

    def bands(self) -> tuple[LensSystem, ...]:
        """`band(i)` for every band."""
        return tuple(_band(self, i) for i in range(len(self.source)))

    def with_bands(self, systems: Sequence[LensSystem]) -> "MultiBandLensSystem":
        """A copy with each band's light taken from `systems[i]` (e.g. completed by that
        band's term) and the mass model from `systems[0]`; a shared field's shape comes from
        band 0, written into every band's copy."""
        systems = tuple(systems)
        if len(systems) != self.n_bands:
            raise ValueError(f"expected {self.n_bands} band systems, got {len(systems)}")
        src = tuple(s.source for s in systems)
        if "source" in self.shared:
            src = tuple(_tie(src[0], s) for s in src)
        light = None
        if self.lens_light is not None:
            light = tuple(s.lens_light for s in systems)
            if "lens_light" in self.shared:
                light = tuple(_tie(light[0], s) for s in light)
        return eqx.tree_at(
            lambda m: (m.mass, m.source, m.lens_light),
            self,
            (systems[0].mass, src, light),
            is_leaf=lambda x: x is None,
        )

    def tied(self) -> PyTree[bool]:
        """A boolean pytree shaped like the model: True at the leaves that `band` never
        reads (the shape parameters of bands 1, 2, ... of a shared field). `equilens.fit`
        holds them (they follow band 0 when the model is completed)."""
        mask = jtu.tree_map(lambda _: False, self)
        for name in self.shared:
            profiles = getattr(self, name)
            flags = []
            for i, p in enumerate(profiles):
                if i == 0:
                    flags.append(jtu.tree_map(lambda _: False, p))
                else:
                    ones = jtu.tree_map(lambda _: True, p)
                    flags.append(_tie(ones, jtu.tree_map(lambda _: False, p)))
            mask = eqx.tree_at(lambda m, k=name: getattr(m, k), mask, tuple(flags))
        return mask
