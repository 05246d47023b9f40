"""Shared test helpers: registries of example instances and numerical tolerances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens import light, mass


def example_mass_profiles() -> dict[str, mass.AbstractMassProfile]:
    """One example instance of every final mass profile, away from special values."""
    from equilens import LensCosmology
    from equilens.subhalo import Subhalo

    subhalo = Subhalo(
        log10_mass=10.8,
        u=0.3,
        v=-0.4,
        cell_x=0.1,
        cell_y=-0.2,
        half=0.5,
        host_theta_E=1.2,
        cosmology=LensCosmology(0.3, 1.2),
    )
    sie = mass.SIE(theta_E=1.2, e1=0.12, e2=-0.08, center_x=0.05, center_y=-0.03)
    return {
        "SIS": mass.SIS(theta_E=1.1, center_x=0.05, center_y=-0.03),
        "SIE": sie,
        "EPL": mass.EPL(theta_E=1.2, gamma=2.2, e1=-0.1, e2=0.15, center_x=0.05, center_y=0.02),
        "NFW": mass.NFW(Rs=1.5, alpha_Rs=0.7, center_x=-0.1, center_y=0.05),
        "EllipticalNFW": mass.EllipticalNFW(
            Rs=1.5, alpha_Rs=0.7, e1=0.1, e2=0.05, center_x=-0.1, center_y=0.05
        ),
        "TNFW": mass.TNFW(Rs=0.4, alpha_Rs=0.15, r_trunc=1.3, center_x=0.2, center_y=-0.1),
        "PseudoJaffe": mass.PseudoJaffe(sigma0=0.8, Ra=0.05, Rs=0.6, center_x=-0.2, center_y=0.3),
        "Subhalo": subhalo,  # a TNFW of M200 = 10^10.8 Msun (Rs ~ 1.1", r_t ~ 0.8")
        "PointMass": mass.PointMass(theta_E=0.6, center_x=0.1, center_y=0.1),
        "ExternalShear": mass.ExternalShear(gamma1=0.04, gamma2=-0.02, ra_0=0.1, dec_0=0.0),
        "ConvergenceSheet": mass.ConvergenceSheet(kappa=0.07, ra_0=0.1, dec_0=0.0),
        "Multipole": mass.Multipole(m=4, a_m=0.03, phi_m=0.4, center_x=0.05, center_y=-0.03),
        "MassSum": sie + mass.ExternalShear(gamma1=0.03, gamma2=0.01),
        "MassBatch": mass.MassBatch.stack(
            [mass.SIS(0.2, 0.5, 0.3), mass.SIS(0.1, -0.6, 0.2), mass.SIS(0.15, 0.1, -0.7)]
        ),
    }


def example_light_profiles() -> dict[str, light.AbstractLightProfile]:
    sersic = light.Sersic(amp=2.0, R_sersic=0.7, n_sersic=2.5, e1=0.1, e2=-0.05)
    return {
        "Sersic": sersic,
        "Gaussian": light.Gaussian(amp=3.0, sigma=0.5, e1=-0.1, e2=0.2, center_x=0.1),
        "CoreSersic": light.CoreSersic(
            amp=2.0, R_sersic=0.8, Rb=0.15, n_sersic=3.0, gamma=0.4, e1=0.05, e2=0.1
        ),
        "MGE": light.MGE(
            amp=jnp.array([1.0, 2.0, 0.5]), sigma=jnp.array([0.1, 0.4, 1.2]), e1=0.1, e2=0.0
        ),
        "Shapelets": light.Shapelets(
            amp=jnp.linspace(1.0, -0.5, 10), n_max=3, beta=0.5, center_x=0.05
        ),
        "LightSum": sersic + light.Gaussian(amp=1.0, sigma=0.3),
        "FixedLight": light.FixedLight(
            light.MGE(amp=jnp.array([2.0, 0.7]), sigma=jnp.array([0.2, 0.8]), e1=0.1)
        ),
    }


def sample_points(n: int = 64, seed: int = 0, half_width: float = 2.5):
    """Random positions (arcsec) away from profile centres by construction of the draws."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-half_width, half_width, n)
    y = rng.uniform(-half_width, half_width, n)
    return jnp.asarray(x, dtype=jnp.result_type(float)), jnp.asarray(
        y, dtype=jnp.result_type(float)
    )


def default_eps() -> float:
    return float(jnp.finfo(jnp.result_type(float)).eps)


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: relative to the array's scale (robust where b crosses zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = max(float(np.max(np.abs(b))), 1e-300)
    return float(np.max(np.abs(a - b)) / scale)


def cast_tree(tree, dtype):
    """Casts every floating array leaf of a pytree to `dtype`."""
    return jax.tree.map(lambda a: a.astype(dtype) if eqx_is_float(a) else a, tree)


def eqx_is_float(a) -> bool:
    return isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)


def fd_grad(f, params: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of a scalar function of a float64 vector."""
    params = np.asarray(params, dtype=np.float64)
    g = np.zeros_like(params)
    for i in range(params.size):
        e = np.zeros_like(params)
        e[i] = h
        g[i] = (float(f(params + e)) - float(f(params - e))) / (2 * h)
    return g


def final_subclasses(root: type) -> set[str]:
    """Names of every final (non-`Abstract*`) equilens subclass of `root`."""
    out = set()
    stack = [root]
    while stack:
        for sub in stack.pop().__subclasses__():
            if not sub.__name__.startswith("Abstract") and sub.__module__.startswith("equilens"):
                out.add(sub.__name__)
            stack.append(sub)
    return out


def slow_ci(fn):
    """Marks a test `slow` and `ci`: out of the README's test command (the fast suite), run
    by `nox -s slow-ci` on every `.ci/run`. For the tests that start processes (each imports
    JAX anew: 5-30 s on the 2-core machine) or run a whole fit, and for float64-only checks
    whose compiles take 10-20 s (the README's command must stay under 12 minutes)."""
    return pytest.mark.slow(pytest.mark.ci(fn))
