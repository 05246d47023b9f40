"""Property-based tests of `equilens.solve.save` / `load`: a model drawn from the profile
classes comes back bit for bit; a file saved from another layout, truncated anywhere, or
with any one byte changed is refused with a `ValueError`, never loaded as a different
model."""

import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import equilens as el
from equilens import light, mass
from equilens.solve import load, save

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _value(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


CENTRE = {"center_x": _value(-1, 1), "center_y": _value(-1, 1)}
ELLIPSE = {"e1": _value(-0.4, 0.4), "e2": _value(-0.4, 0.4)}
MASSES = [
    st.builds(mass.SIS, theta_E=_value(0.1, 3), **CENTRE),
    st.builds(mass.SIE, theta_E=_value(0.1, 3), **ELLIPSE, **CENTRE),
    st.builds(mass.EPL, theta_E=_value(0.1, 3), gamma=_value(1.5, 2.5), **ELLIPSE, **CENTRE),
    st.builds(mass.ExternalShear, gamma1=_value(-0.1, 0.1), gamma2=_value(-0.1, 0.1)),
]
LIGHTS = [
    st.builds(
        light.Sersic,
        amp=_value(0.1, 10),
        R_sersic=_value(0.05, 2),
        n_sersic=_value(0.5, 6),
        **ELLIPSE,
        **CENTRE,
    ),
    st.builds(light.Gaussian, amp=_value(0.1, 10), sigma=_value(0.05, 2), **CENTRE),
]


#: The parts of a model: masses, sources, lens light or None. (The model is put together in
#: the test: beartype checks a tuple field with one random item, and hypothesis refuses
#: strategies that use Python's `random`.)
PARTS = st.tuples(
    st.lists(st.one_of(MASSES), min_size=1, max_size=3),
    st.lists(st.one_of(LIGHTS), min_size=1, max_size=2),
    st.one_of(st.none(), st.one_of(LIGHTS)),
)


def _model(parts) -> el.LensSystem:
    masses, sources, lens_light = parts
    return el.LensSystem(
        mass=masses[0] if len(masses) == 1 else mass.MassSum(tuple(masses)),
        source=sources[0] if len(sources) == 1 else light.LightSum(tuple(sources)),
        lens_light=lens_light,
    )


def _leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@SETTINGS
@given(parts=PARTS, other_parts=PARTS)
def test_round_trip_is_exact_and_another_layout_is_refused(parts, other_parts):
    model, other = _model(parts), _model(other_parts)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.eqx"
        save(path, model)
        # `like` only lends the structure: its values are not read
        blank = jax.tree.map(jnp.zeros_like, model)
        _assert_same(load(path, blank), model)
        if jax.tree.structure(other) == jax.tree.structure(model):
            event("the same layout drawn twice")
            return
        with pytest.raises(ValueError, match="another layout"):
            load(path, other)


@SETTINGS
@given(parts=PARTS, data=st.data())
def test_truncated_or_changed_files_are_refused(parts, data):
    model = _model(parts)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.eqx"
        save(path, model)
        raw = path.read_bytes()
        cut = data.draw(st.integers(0, len(raw) - 1), label="truncated at")
        path.write_bytes(raw[:cut])
        with pytest.raises(ValueError):
            load(path, model)
        at = data.draw(st.integers(0, len(raw) - 1), label="byte changed")
        flip = data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(raw[:at] + bytes([raw[at] ^ flip]) + raw[at + 1 :])
        with pytest.raises(ValueError):
            load(path, model)


def test_files_of_equinox_alone_still_load_and_are_checked_for_size(tmp_path):
    """Files written by `eqx.tree_serialise_leaves` (equilens 0.1.0's `save`) load; one of
    another model with more leaves is refused."""
    sie = el.LensSystem(mass=mass.SIE(theta_E=1.1, e1=0.1), source=light.Gaussian(2.0, 0.2))
    sis = el.LensSystem(mass=mass.SIS(theta_E=1.0), source=light.Gaussian(1.0, 0.1))
    path = tmp_path / "old.eqx"
    eqx.tree_serialise_leaves(path, sie)
    _assert_same(load(path, sie), sie)
    with pytest.raises(ValueError, match="more leaves than"):
        load(path, sis)


def test_a_header_changed_without_changing_its_meaning_is_refused_and_format_1_loads(tmp_path):
    """A space of the layout's JSON turned into a tab (the same JSON: hypothesis found it)
    is refused by the layout's checksum; a file of format 1 (no layout checksum, equilens
    before 2026-12-03) still loads."""
    import json
    import zlib

    from equilens.solve._io import _MAGIC

    sie = el.LensSystem(mass=mass.SIE(theta_E=1.1, e1=0.1), source=light.Gaussian(2.0, 0.2))
    path = tmp_path / "model.eqx"
    save(path, sie)
    raw = path.read_bytes()
    at = raw.index(b", ", len(_MAGIC) + 8) + 1
    path.write_bytes(raw[:at] + b"\t" + raw[at + 1 :])
    with pytest.raises(ValueError, match="damaged"):
        load(path, sie)
    # format 1, as written before: the header, then the leaves
    start = len(_MAGIC) + 8
    n = int.from_bytes(raw[len(_MAGIC) : start], "little")
    header = json.loads(raw[start : start + n])
    assert header["format"] == 2
    payload = raw[start + n + 4 :]
    assert zlib.crc32(payload) == header["crc32"]
    old = json.dumps({**header, "format": 1}).encode()
    path.write_bytes(_MAGIC + len(old).to_bytes(8, "little") + old + payload)
    _assert_same(load(path, sie), sie)


@pytest.mark.x64_only
def test_precision_follows_like(tmp_path):
    """A float64 save loads into a float32 model as float32, and back."""
    model = el.LensSystem(mass=mass.SIE(theta_E=1.1, e1=0.1), source=light.Gaussian(2.0, 0.2))
    single = jax.tree.map(lambda x: x.astype(jnp.float32), model)
    save(tmp_path / "64.eqx", model)
    save(tmp_path / "32.eqx", single)
    down = load(tmp_path / "64.eqx", single)
    assert {x.dtype for x in _leaves(down)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(down.mass.theta_E, 1.1, rtol=1e-7)
    up = load(tmp_path / "32.eqx", model)
    assert {x.dtype for x in _leaves(up)} == {jnp.dtype(jnp.float64)}
