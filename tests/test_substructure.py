"""Halo populations (equilens.substructure): pyHalo's realisations as a MultiPlane, against
lenstronomy's multi-plane ray shooting of the same realisation; reproducible draws; CDM
against WDM; lenstronomy's names."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens import mass, substructure
from equilens.mass import MultiPlane

# (small populations: masses 1e8-1e10 Msun in a 5" cone)
POP = dict(sigma_sub=0.05, log_mlow=8.0, log_mhigh=10.0, cone_opening_angle_arcsec=5.0)
MACRO = mass.SIE(theta_E=1.0, e1=0.1, e2=-0.03) + mass.ExternalShear(0.02, 0.01)


def test_lenstronomy_names_and_bad_input():
    (tnfw, sheet) = substructure.from_lenstronomy(
        ["TNFW", "CONVERGENCE"],
        [dict(Rs=0.1, alpha_Rs=0.01, r_trunc=0.5, center_x=0.1, center_y=0.2), dict(kappa=-0.01)],
    )
    assert isinstance(tnfw, mass.TNFW) and float(tnfw.r_trunc) == 0.5
    assert isinstance(sheet, mass.ConvergenceSheet) and float(sheet.kappa) == pytest.approx(-0.01)
    with pytest.raises(ValueError, match="GNFW"):
        substructure.from_lenstronomy(["GNFW"], [dict()])
    with pytest.raises(ValueError, match="dark_matter"):
        substructure.population(0.5, 1.5, "SIDM")
    with pytest.raises(ValueError, match="z_lens < z_source"):
        substructure.population(1.5, 0.5)
    with pytest.raises(ValueError, match="log_mc"):
        substructure.population(0.5, 1.5, "WDM")


@pytest.mark.crosscheck
@pytest.mark.x64_only
def test_a_pyhalo_realisation_traces_as_in_lenstronomy():
    pytest.importorskip("pyHalo")
    from lenstronomy.LensModel.lens_model import LensModel
    from pyHalo.PresetModels.cdm import CDM

    # (pyHalo draws from NumPy's global generator)
    state = np.random.get_state()  # noqa: NPY002
    np.random.seed(3)  # noqa: NPY002
    try:
        with warnings.catch_warnings():  # (pyHalo calls a deprecated astropy function)
            warnings.simplefilter("ignore")
            realization = CDM(0.5, 1.5, **POP)
            names, zs, kwargs, _ = realization.lensing_quantities()
    finally:
        np.random.set_state(state)  # noqa: NPY002
    lens = substructure.from_pyhalo(realization, MACRO)
    n_halos = sum(n == "TNFW" for n in names)
    assert n_halos > 20 and "CONVERGENCE" in names
    assert sum(int(np.sum(p)) for p in lens.present) == len(names) + 2
    macro_kwargs = [
        dict(theta_E=1.0, e1=0.1, e2=-0.03, center_x=0.0, center_y=0.0),
        dict(gamma1=0.02, gamma2=0.01, ra_0=0.0, dec_0=0.0),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = LensModel(
            ["SIE", "SHEAR", *names],
            z_source=1.5,
            lens_redshift_list=[0.5, 0.5, *zs],
            multi_plane=True,
            cosmo=realization.lens_cosmo.cosmo.astropy,
        )
    x, y = np.random.default_rng(0).uniform(-2.0, 2.0, (2, 400))
    bx, by = theirs.ray_shooting(x, y, macro_kwargs + list(kwargs))
    mx, my = eqx.filter_jit(MultiPlane.trace)(lens, jnp.asarray(x), jnp.asarray(y))
    err = float(np.max(np.hypot(np.asarray(mx) - bx, np.asarray(my) - by)))
    print(f"\npyHalo realisation ({n_halos} halos) vs lenstronomy: {err:.2e} arcsec")
    assert err < 1e-8


@pytest.mark.crosscheck
@pytest.mark.x64_only
def test_populations_are_reproducible_sheeted_and_stack():
    pytest.importorskip("pyHalo")
    a = substructure.population(0.5, 1.5, seed=7, macro=MACRO, **POP)
    b = substructure.population(0.5, 1.5, seed=7, macro=MACRO, **POP)
    c = substructure.population(0.5, 1.5, seed=8, macro=MACRO, **POP)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(u), np.asarray(v))
    tnfw = next(i for i, k in enumerate(a.kinds) if isinstance(k, mass.TNFW))
    ra, rc = np.asarray(a.kinds[tnfw].Rs), np.asarray(c.kinds[tnfw].Rs)
    assert ra.shape != rc.shape or not np.array_equal(ra, rc)
    # the mass sheets: one per plane at least, negative (they take the halos' mean mass away)
    sheets = next(i for i, k in enumerate(a.kinds) if isinstance(k, mass.ConvergenceSheet))
    assert all(any(isinstance(m, mass.ConvergenceSheet) for m in ms) for _, ms in a.components())
    assert float(np.max(np.asarray(a.kinds[sheets].kappa))) < 0.0
    bare = substructure.population(0.5, 1.5, seed=7, macro=MACRO, mass_sheets=False, **POP)
    assert not any(isinstance(k, mass.ConvergenceSheet) for k in bare.kinds)
    # realisations share pyHalo's planes: one vmapped batch
    batch = MultiPlane.stack([a, c])
    x, y = jnp.linspace(-1.5, 1.5, 20), jnp.linspace(1.0, -1.2, 20)
    bx, _ = eqx.filter_vmap(lambda m: m.trace(x, y))(batch)
    assert float(jnp.max(jnp.abs(bx[1] - c.trace(x, y)[0]))) < 1e-13
    # warm dark matter (half-mode mass 1e9 Msun) suppresses the small halos
    warm = substructure.population(0.5, 1.5, "WDM", seed=7, log_mc=9.0, **POP)
    n_cold = int(np.sum(np.asarray(a.present[tnfw])))
    n_warm = sum(isinstance(m, mass.TNFW) for _, ms in warm.components() for m in ms)
    assert n_warm < 0.8 * n_cold


@pytest.mark.crosscheck
@pytest.mark.x64_only
def test_the_substructure_page_snippets_run_with_pyhalo():
    pytest.importorskip("pyHalo")
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "substructure.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    ns: dict = {}
    exec(compile("\n".join(blocks), "<substructure.md>", "exec"), ns)
    pop = ns["pop"]
    n = sum(isinstance(m, mass.TNFW) for _, ms in pop.components() for m in ms)
    assert isinstance(pop, MultiPlane) and n > 300 and len(pop.plane_redshifts) > 50
