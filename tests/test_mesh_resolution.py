"""The source mesh's resolution chosen by the evidence: `finer_mesh` and
`fit_pixelized(finer_meshes=)`."""

import jax
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from equilens.solve import MAX_FILL, MESH_GAIN, finer_mesh

PS = 0.05


def test_finer_mesh_keeps_the_kind_and_its_settings_and_stops_at_the_data():
    rect = finer_mesh(el.RectangularMesh((32, 24), bounds=(-1.0, 1.0, -0.5, 0.5)), 10_000)
    assert isinstance(rect, el.RectangularMesh)
    assert rect.shape == (40, 30) and rect.bounds == (-1.0, 1.0, -0.5, 0.5)
    adaptive = el.AdaptiveRectangularMesh((40, 40), weight_floor=0.1, weight_power=0.5)
    finer = finer_mesh(adaptive, 10_000)
    assert isinstance(finer, el.AdaptiveRectangularMesh)
    assert finer.shape == (50, 50)
    assert (finer.weight_floor, finer.weight_power) == (0.1, 0.5)
    # at most MAX_FILL source pixels per pixel of data: 40 x 40 needs 3,200 data pixels
    assert finer_mesh(el.AdaptiveRectangularMesh((32, 32)), int(1600 / MAX_FILL)) is not None
    assert finer_mesh(el.AdaptiveRectangularMesh((32, 32)), int(1600 / MAX_FILL) - 1) is None
    grid = el.Grid((20, 20), pixel_scale=PS)
    delaunay = el.DelaunayMesh.from_mask(grid, np.asarray(grid.circular_mask(0.4)), 30)
    assert finer_mesh(delaunay, 10_000) is None


def _compact_source_lens():
    """A lens whose source has a compact bright clump beside a smooth disc: an 8 x 8 mesh
    cannot resolve it."""
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.0, e1=0.08, e2=-0.03) + mass.ExternalShear(0.02, 0.01),
        source=light.Sersic(amp=8.0, R_sersic=0.2, n_sersic=1.0, e1=0.2, center_x=0.03)
        + light.Gaussian(amp=6.0, sigma=0.025, center_x=0.08, center_y=-0.04),
    )
    grid = el.Grid((56, 56), pixel_scale=PS)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=PS, truncation=3.0)
    imaging = el.simulate(
        jax.random.key(3),
        truth,
        grid,
        psf,
        exposure_time=2000.0,
        sky_level=1.0,
        mask=grid.annular_mask(0.3, 1.4),
    )
    return imaging


@pytest.mark.slow
@pytest.mark.x64_only
def test_finer_meshes_are_kept_while_the_evidence_rises_by_enough():
    imaging = _compact_source_lens()
    start = el.LensSystem(
        mass=mass.SIE(theta_E=0.98, e1=0.06, e2=-0.02) + mass.ExternalShear(0.0, 0.0),
        source=el.PixelizedSource(
            el.AdaptiveRectangularMesh((8, 8)), el.ConstantRegularization(1.0)
        ),
    )
    result, inversion, stages = el.solve.fit_pixelized(
        imaging, start, light_rounds=0, finer_meshes=3, max_steps=300, log=None
    )
    names = [s["stage"] for s in stages]
    assert names[:2] == ["stage 1 (regularization)", "stage 2 (mass)"]
    finer = [s for s in stages if "finer source mesh" in s["stage"]]
    assert finer and finer[0]["stage"] == "stage 3 (finer source mesh (10 x 10))"
    # each kept mesh raised the evidence by more than MESH_GAIN over the last kept one; the
    # rounds stop at the first that does not (or after three)
    kept, shape = stages[1]["log_evidence"], (8, 8)
    for s in finer:
        gain = s["log_evidence"] - kept
        if gain > MESH_GAIN and s["status"] == "successful":
            kept = s["log_evidence"]
            shape = tuple(int(v) for v in s["stage"].split("(")[-1].rstrip(")").split(" x "))
        else:
            assert s is finer[-1]
    assert shape != (8, 8), "an 8 x 8 mesh resolves the clump as well as a finer one"
    assert result.model.source.mesh.shape == shape
    assert isinstance(result.model.source.mesh, el.AdaptiveRectangularMesh)
    # the result is the kept stage (refitted once more from its minimum for its errors)
    assert float(inversion.log_evidence) == pytest.approx(kept, rel=1e-6)
    assert float(result.model.mass.components[0].theta_E) == pytest.approx(1.0, abs=0.01)
    with pytest.raises(ValueError, match="finer_meshes"):
        el.solve.fit_pixelized(imaging, start, finer_meshes=-1, log=None)
