"""The `equilens` command: the demo fit on the shipped HST data, `fit`, and bad input."""

import contextlib
import io
import json
import math
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from astropy.io import fits
from hypothesis import HealthCheck, event, given, settings, strategies as st

import equilens as el
from equilens import light, mass
from equilens.cli import REGULARIZATIONS, main
from helpers import slow_ci

# the command turns float64 on for its process: run these in the float64 session only
pytestmark = pytest.mark.x64_only


@pytest.mark.slow
@pytest.mark.ci
def test_demo_fits_the_hst_lens(tmp_path, capsys):
    assert main(["demo", "--output", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "demo.json").read_text())
    sie = out["components"][0]
    assert sie["class"] == "SIE" and out["components"][1]["class"] == "ExternalShear"
    theta_e = sie["parameters"]["theta_E"]["value"]
    # Bolton et al. (2008): 1.38"; Gavazzi et al. (2008): 1.43" for the inner ring; the
    # demo's smooth SIE + shear gets 1.404"
    assert 1.38 < theta_e < 1.43, theta_e
    assert 0 < sie["parameters"]["theta_E"]["error"] < 0.01
    lens = [c for c in out["components"] if c["field"] == "lens_light"]
    assert [c["class"] for c in lens] == ["MGE"]  # the default lens light
    assert lens[0]["parameters"]["amp"]["error"] == "linear"
    assert len(lens[0]["parameters"]["amp"]["value"]) == 20
    # the MGE follows the galaxy: reduced chi2 1.23 (a Sersic lens light leaves 2.18)
    assert out["reduced_chi2"] < 1.5 and out["status"] == "successful" and out["success"]
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    printed = capsys.readouterr().out
    assert "mass.components[0].theta_E" in printed


@pytest.fixture(scope="module")
def fits_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.0, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01),
        lens_light=light.Sersic(amp=3.0, R_sersic=0.5, n_sersic=3.0, e1=0.05),
        source=light.Sersic(amp=15.0, R_sersic=0.12, n_sersic=1.2, center_x=0.05, e2=0.1),
    )
    grid = el.Grid((50, 50), 0.06)
    psf = el.GaussianPSF(0.12, 0.06)
    data = el.simulate(jax.random.key(0), truth, grid, psf, exposure_time=1500.0, sky_level=0.5)
    no_light = el.LensSystem(mass=truth.mass, source=truth.source)
    dark = el.simulate(jax.random.key(1), no_light, grid, psf, exposure_time=1500.0, sky_level=0.5)
    paths = {}
    for name, arr in [
        ("image", data.data),
        ("noise", data.noise_map),
        ("dark", dark.data),
        ("dark_noise", dark.noise_map),
        ("psf", psf.kernel()),
        ("mask", np.zeros(grid.shape, dtype=np.int16)),
        ("small", np.zeros((10, 10))),
    ]:
        paths[name] = str(folder / f"{name}.fits")
        fits.PrimaryHDU(np.asarray(arr)).writeto(paths[name])
    nan_image = np.asarray(data.data).copy()
    nan_image[25, 25] = np.nan
    paths["nan"] = str(folder / "nan.fits")
    fits.PrimaryHDU(nan_image).writeto(paths["nan"])
    return paths


def _args(paths, **override):
    base = {
        "image": paths["image"],
        "--noise-map": paths["noise"],
        "--psf": paths["psf"],
        "--pixel-scale": "0.06",
        "--mask": paths["mask"],
        "--mask-radius": "1.4",
        "--mass": "sie+shear",
        "--lens-light": "sersic",
        "--source": "sersic",
    }
    base.update(override)
    out = ["fit", base.pop("image")]
    for k, v in base.items():
        if v is True:  # a flag
            out.append(k)
        elif v is not None:
            out += [k, v]
    return out


@pytest.mark.slow
@pytest.mark.ci
def test_fit_command_writes_json_and_png(fits_files, tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert main([*_args(fits_files), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    sie = result["components"][0]["parameters"]
    assert abs(sie["theta_E"]["value"] - 1.0) < 5 * sie["theta_E"]["error"] + 2e-3
    assert set(sie) == {"theta_E", "e1", "e2", "center_x", "center_y"}
    assert [c["class"] for c in result["components"]] == [
        "SIE",
        "ExternalShear",
        "Sersic",
        "Sersic",
    ]
    for key in ("chi2", "reduced_chi2", "wall_time_s"):
        assert key in result
    assert 0.8 < result["reduced_chi2"] < 1.3
    # the model's own family: no arcs left in the residuals (noise alone gives about 1)
    arcs = result["arc_residuals"]
    assert arcs["n_arcs"] > 50 and arcs["excess"] < 2.0, arcs
    assert (tmp_path / "fit.png").exists()
    # the source's wings continue beyond the circle of 1.4": the mask grows onto them
    # (`equilens.solve.fit_to_arcs`; tests/test_mask_growth.py checks what joins)
    assert result["mask"]["added"] > 20 and result["mask"]["pixels"] == result["n_data"]
    assert "pixels added" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.ci
def test_fit_that_does_not_converge_exits_with_status_2(fits_files, tmp_path, capsys):
    """One solver step per fit cannot converge: the results are written, stderr says why,
    and the exit status is 2 (not 0: a failed fit is not a success; not 1: no bad input)."""
    out = tmp_path / "short.json"
    argv = [*_args(fits_files), "--max-steps", "1", "--fixed-mask", "--json", str(out)]
    assert main(argv) == 2
    result = json.loads(out.read_text())
    assert result["success"] is False and "maximum number of steps" in result["status"]
    assert "mask" not in result  # --fixed-mask: not grown, not checked
    assert (tmp_path / "short.png").exists()
    assert "the fit did not succeed" in capsys.readouterr().err


@slow_ci
def test_ctrl_c_writes_the_finished_stage_and_exits_130(fits_files, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the search (after the lens-light stage): one line on stderr, exit
    status 130, and the lens-light stage's fit written as the JSON, marked interrupted;
    Ctrl-C before any stage ends writes nothing."""
    import equilens.solve._pipeline as pipeline

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "search", interrupt)
    out = tmp_path / "cut.json"
    assert main([*_args(fits_files), "--max-steps", "5", "--json", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"equilens: interrupted; the result of stage 'lens light' written to {out}"
    result = json.loads(out.read_text())
    assert result["interrupted"] is True and "interrupted" in result["status"]
    assert [c["class"] for c in result["components"]][:2] == ["SIE", "ExternalShear"]
    # interrupted before the first stage ends: nothing written
    monkeypatch.setattr(pipeline, "fit", interrupt)
    none = tmp_path / "none.json"
    assert main([*_args(fits_files), "--json", str(none)]) == 130
    assert capsys.readouterr().err.strip() == "equilens: interrupted; nothing finished to write"
    assert not none.exists()


@pytest.mark.slow
def test_pixelized_fit_writes_evidence_and_source_fits(fits_files, tmp_path):
    out = tmp_path / "pix.json"
    argv = _args(fits_files, **{"--source": "pixelized", "--mesh": "adaptive:12x12"})
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert np.isfinite(result["log_evidence"])
    # both stages checked for arcs left in their residuals
    for arcs in (result["arc_residuals"], result["parametric_stage"]["arc_residuals"]):
        assert arcs["n_arcs"] > 50 and arcs["excess"] < 2.0, arcs
    # the chain held the images of the parametric source's centre together: every stage
    # stayed inside the threshold
    assert len(result["positions"]) >= 2
    assert all(stage["positions_penalty"] == 0.0 for stage in result["stages"])
    source = result["components"][-1]
    assert source["class"] == "PixelizedSource" and source["n_pixels"] == 144
    assert source["mesh"] == "AdaptiveRectangularMesh"
    strength = source["parameters"]["regularization.coefficient"]
    assert strength["value"] > 0 and strength["error"] is not None  # fitted by the evidence
    sie = result["components"][0]["parameters"]
    assert abs(sie["theta_E"]["value"] - 1.0) < 0.03
    with fits.open(result["source_fits"]) as hdul:
        image, errors = hdul[0].data, hdul["ERRORS"].data
        assert hdul[0].header["PIXSCALE"] > 0
    assert image.shape == errors.shape == (120, 120)
    assert np.nanmax(image) > 5 * np.nanmedian(errors)  # a detected source
    assert (tmp_path / "pix.png").exists()


#: The data image passed as its own PSF (an odd-sized cut-out, same size as the image)
ODD_AS_PSF = {
    "image": "ODD_IMAGE",
    "--noise-map": "ODD_NOISE",
    "--mask": "ODD_MASK",
    "--psf": "ODD_IMAGE",
}


@pytest.mark.parametrize(
    "override, message",
    [
        ({"--source": "pixelized", "--mesh": "hexagonal"}, "--mesh must be one of"),
        ({"--source": "pixelized", "--mesh": "adaptive:12"}, "size must be NYxNX"),
        ({"--source": "pixelized", "--regularization": "tv"}, "--regularization must be one of"),
        ({"image": "/nonexistent/image.fits"}, "image file not found"),
        ({"--noise-map": "SMALL"}, "does not match"),
        ({"image": "NAN"}, "NaN"),
        ({"--mass": "sie+banana"}, "unknown mass profile 'banana'"),
        ({"--source": "blob"}, "unknown source profile 'blob'"),
        ({"--pixel-scale": "-1"}, "--pixel-scale must be > 0"),
        ({"--mask-radius": "0"}, "--mask-radius must be > 0"),
        ({"--max-steps": "0"}, "--max-steps must be between 1 and"),
        ({"--positions": "/nonexistent/positions.txt"}, "positions file not found"),
        ({"--positions": "WORDS"}, "cannot read --positions"),
        ({"--positions": "THREE"}, "two columns (x y)"),
        # the image passed as its own PSF (same size): refused, by --check too
        (ODD_AS_PSF, "is as large as the image (49x49) (it equals the image)"),
        ({**ODD_AS_PSF, "--check": True}, "is as large as the image"),
        ({"--power-law": True}, "--power-law is an option of --source pixelized"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(fits_files, tmp_path, capsys, override, message):
    (tmp_path / "words.txt").write_text("left image\nright image\n")
    (tmp_path / "three.txt").write_text("0.1 0.2 0.3\n-0.1 -0.2 -0.3\n")
    swap = {
        "SMALL": fits_files["small"],
        "NAN": fits_files["nan"],
        "WORDS": str(tmp_path / "words.txt"),
        "THREE": str(tmp_path / "three.txt"),
    }
    for name in ("image", "noise", "mask"):  # 49x49 cut-outs: an odd image passes as a PSF
        swap[f"ODD_{name.upper()}"] = str(tmp_path / f"odd_{name}.fits")
        fits.PrimaryHDU(fits.getdata(fits_files[name])[:49, :49]).writeto(
            swap[f"ODD_{name.upper()}"]
        )
    override = {k: swap.get(v, v) if isinstance(v, str) else v for k, v in override.items()}
    code = main([*_args(fits_files, **override), "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err.startswith("equilens: error:") and "\n" not in err, err
    assert message in err, err


def test_a_nan_border_outside_the_mask_radius_is_ignored_and_counted(fits_files, tmp_path, capsys):
    from equilens.cli import _load

    image = fits.getdata(fits_files["image"]).astype(float)
    image[:, :2] = np.nan  # 50x50 at 0.06": these columns are 1.4" or more from the centre
    path = str(tmp_path / "border.fits")
    fits.PrimaryHDU(image).writeto(path)
    args = (path, fits_files["noise"], fits_files["psf"], 0.06)
    imaging = _load(*args, fits_files["mask"], 1.3, 1)
    assert f"{path}: 100 bad pixels (NaN, inf or noise <= 0) outside the mask, ignored" in (
        capsys.readouterr().out
    )
    assert bool(np.all(np.isfinite(np.asarray(imaging.data))))
    # without the radius the NaN are inside the mask: refused, as before
    with pytest.raises(ValueError, match="NaN/inf pixels inside the mask"):
        _load(*args, fits_files["mask"], None, 1)


def test_sample_help_describes_both_samplers(capsys):
    with pytest.raises(SystemExit) as err:
        main(["sample", "--help"])
    assert err.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--sampler nuts", "--sampler nested", "--sampler auto", "log-evidence", "R-hat"):
        assert words in text, words


def test_sample_picks_nested_sampling_on_a_cpu():
    from equilens.cli import choose_sampler

    assert jax.default_backend() == "cpu"
    name, why = choose_sampler()
    assert name == "nested" and "on a CPU" in why and "core" in why


@slow_ci
def test_ctrl_c_during_nested_sampling_writes_the_points_so_far(
    fits_files, tmp_path, capsys, monkeypatch
):
    """`equilens sample` interrupted while nested sampling: the posterior so far written
    (JSON marked "interrupted", NetCDF, corner plot), one line, exit status 130. (The fit
    is a short one and the interruption is raised by the sampler's stand-in: this checks
    the command's handling, test_nested.py the sampler's.)"""
    pytest.importorskip("nautilus")
    pytest.importorskip("arviz")
    pytest.importorskip("corner")
    import equilens.solve as solve
    from equilens.objective import Objective
    from equilens.solve._parametrise import parametrisation
    from equilens.solve._start import start_model

    def short_fit(imaging, mass, lens_light, source, **kwargs):
        objective = Objective(el.GaussianLikelihood(imaging, nonnegative=True))
        return el.fit(
            objective, start_model(imaging, mass, lens_light, source), max_steps=2, throw=False
        )

    def interrupted(objective, result, **kwargs):
        param = parametrisation(objective, result.model, None, None)
        rng = np.random.default_rng(0)
        values = np.asarray(result.values)
        points = values + 1e-3 * rng.standard_normal((50, values.size))
        post = el.NestedPosterior(
            points=points, log_weights=np.full(50, -np.log(50.0)),
            log_likelihood=np.zeros(50), log_evidence=1.0, log_evidence_error=0.5,
            n_eff=50.0, n_likelihood=50, box=np.stack([values - 1, values + 1], axis=1),
            template=result.model, parametrisation=param, names=tuple(result.names),
            backend="numba", status="interrupted",
        )  # fmt: skip
        raise el.NestedInterrupted(post)

    monkeypatch.setattr(solve, "fit_lens", short_fit)
    monkeypatch.setattr(solve, "nested_sample", interrupted)
    out = tmp_path / "stopped.json"
    argv = _sample_args(fits_files, "--mass", "sie", "--lens-light", "none")
    assert main([*argv, "--sampler", "nested", "--json", str(out)]) == 130
    post = json.loads(out.read_text())["posterior"]
    assert post["status"] == "interrupted" and post["likelihood_calls"] == 50
    assert (tmp_path / "stopped.nc").stat().st_size > 0
    assert (tmp_path / "stopped_corner.png").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"equilens: interrupted; the result of stage 'nested sampling' written to {out}"
    )


def test_unknown_command_exits_nonzero():
    with pytest.raises(SystemExit) as err:
        main(["nonsense"])
    assert err.value.code != 0


@pytest.fixture(scope="module")
def band_file(tmp_path_factory):
    """Two bands of one lens in one multi-extension FITS file (a bluer, sharper band 0 at
    0.06"/pixel and a redder band 1 at 0.1"/pixel with a wider PSF)."""
    folder = tmp_path_factory.mktemp("bands")
    hdus = [fits.PrimaryHDU()]
    for k, (name, scale, fwhm, side, lens_amp, source_amp) in enumerate(
        [("G", 0.06, 0.12, 50, 3.0, 15.0), ("R", 0.1, 0.25, 30, 8.0, 10.0)]
    ):
        truth = el.LensSystem(
            mass=mass.SIE(theta_E=1.0, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01),
            lens_light=light.Sersic(amp=lens_amp, R_sersic=0.5, n_sersic=3.0, e1=0.05),
            source=light.Sersic(amp=source_amp, R_sersic=0.12, n_sersic=1.2, center_x=0.05),
        )
        grid = el.Grid((side, side), scale)
        psf = el.GaussianPSF(fwhm, scale)
        data = el.simulate(jax.random.key(k), truth, grid, psf, exposure_time=1500.0, sky_level=0.5)
        hdus += [
            fits.ImageHDU(np.asarray(data.data), name=f"{name}_FLUX"),
            fits.ImageHDU(np.asarray(data.noise_map), name=f"{name}_RMS"),
            fits.ImageHDU(np.asarray(psf.kernel()), name=f"{name}_PSF"),
        ]
    path = str(folder / "bands.fits")
    fits.HDUList(hdus).writeto(path)
    return path


def _band_args(path, names=("G", "R")):
    out = ["fit"]
    for n in names:
        out += ["--band", f"{path}[{n}_FLUX]", f"{path}[{n}_RMS]", f"{path}[{n}_PSF]"]
    return out


@pytest.mark.slow
def test_fit_command_fits_bands_jointly(band_file, tmp_path):
    out = tmp_path / "joint.json"
    argv = [
        *_band_args(band_file),
        "--band-pixel-scales", "0.06,0.1",
        "--band-names", "G,R",
        "--mask-radius", "1.4",
        "--lens-light", "sersic",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    sie = result["components"][0]["parameters"]
    assert abs(sie["theta_E"]["value"] - 1.0) < 5 * sie["theta_E"]["error"] + 2e-3
    sources = [c for c in result["components"] if c["field"] == "source"]
    assert [c["band"] for c in sources] == ["G", "R"]
    amps = [c["parameters"]["amp"]["value"] for c in sources]
    # (each amplitude is degenerate with the shared size; their ratio, the colour, is not)
    assert abs(amps[0] / 15.0 - 1) < 0.2 and abs(amps[1] / 10.0 - 1) < 0.2
    assert abs(amps[0] / amps[1] / 1.5 - 1) < 0.1
    # the shared source size is reported in both bands, with the one error
    sizes = [c["parameters"]["R_sersic"] for c in sources]
    assert sizes[0] == sizes[1] and sizes[0]["error"] > 0
    assert [b["name"] for b in result["bands"]] == ["G", "R"]
    assert all(0.7 < b["chi2"] / b["n_data"] < 1.3 for b in result["bands"])
    assert (tmp_path / "joint_G.png").exists() and (tmp_path / "joint_R.png").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--pixel-scale (all bands) or --band-pixel-scales"),
        (["--band-pixel-scales", "0.06"], "lists 1 scales for 2 bands"),
        (["--band-pixel-scales", "0.06,fast"], "must be numbers"),
        (["--pixel-scale", "0.06", "--band-names", "G"], "lists 1 names for 2 bands"),
        (["--pixel-scale", "0.06", "--band-names", "G,G"], "band names must be unique"),
        (["--pixel-scale", "0.06", "--source", "pixelized", "--mesh", "hex"], "--mesh must be"),
        (["--pixel-scale", "0.06", "--psf", "x.fits"], "give either IMAGE"),
    ],
)
def test_bad_band_input_is_one_line_and_nonzero(band_file, tmp_path, capsys, extra, message):
    argv = [*_band_args(band_file), *extra, "--json", str(tmp_path / "x.json")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("equilens: error:") and "\n" not in err, err
    assert message in err, err


def test_missing_band_extension_names_the_band(band_file, tmp_path, capsys):
    argv = [*_band_args(band_file, names=("G", "B")), "--pixel-scale", "0.06"]
    assert main([*argv, "--json", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert "band band1:" in err and "no image data in HDU B_FLUX" in err, err


def test_check_names_the_power_law_stage_and_the_mask_growth(
    fits_files, band_file, tmp_path, capsys
):
    out = ["--json", str(tmp_path / "x.json"), "--check"]
    for override, runs in (
        ({"--source": "pixelized", "--power-law": True}, True),
        ({"--source": "pixelized"}, False),  # not by default
        ({"--source": "pixelized", "--mass": "epl+shear", "--power-law": True}, False),
    ):
        assert main([*_args(fits_files, **override), *out]) == 0
        printed = capsys.readouterr().out
        assert "pixelized source:" in printed
        assert ("then the power-law stage" in printed) == runs, (override, printed)
    # the mask: grown onto arcs beyond the circle unless --fixed-mask
    assert "mask: grown onto arcs" in printed
    assert main([*_args(fits_files, **{"--fixed-mask": True}), *out]) == 0
    assert "mask: kept as given" in capsys.readouterr().out
    # the joint chain of several bands has no such stage: the flag is refused there
    argv = [*_band_args(band_file), "--band-pixel-scales", "0.06,0.1", "--source", "pixelized"]
    assert main([*argv, "--power-law", *out]) == 1
    assert "not --band" in capsys.readouterr().err


def test_sample_takes_bands_as_fit_does(band_file, tmp_path, capsys):
    sample = ["sample", *_band_args(band_file)[1:], "--band-names", "G,R"]
    argv = [*sample, "--band-pixel-scales", "0.06,0.1", "--check"]
    assert main([*argv, "--json", str(tmp_path / "x.json")]) == 0
    printed = capsys.readouterr().out
    assert "the inputs are valid" in printed and "2 bands (G, R)" in printed
    assert not (tmp_path / "x.json").exists()
    # the band options checked as fit checks them
    argv = [*sample, "--pixel-scale", "0.06", "--psf", "x.fits", "--json", "x.json"]
    assert main(argv) == 1
    assert "give either IMAGE" in capsys.readouterr().err
    assert main(["sample", "--pixel-scale", "0.06", "--json", "x.json"]) == 1
    assert "IMAGE is required (or --band once per band)" in capsys.readouterr().err


@pytest.mark.slow
def test_sample_command_samples_bands_jointly(band_file, tmp_path, capsys):
    pytest.importorskip("nautilus")
    pytest.importorskip("arviz")
    out = tmp_path / "bands.json"
    argv = [
        "sample", *_band_args(band_file)[1:],
        "--band-pixel-scales", "0.06,0.1",
        "--band-names", "G,R",
        "--mask-radius", "1.4",
        "--lens-light", "sersic",
        "--sampler", "nested", "--live", "150", "--samples", "400", "--prior-width", "5",
        "--json", str(out),
    ]  # fmt: skip
    code = main(argv)
    result = json.loads(out.read_text())
    post = result["posterior"]
    assert post["sampler"] == "nautilus" and math.isfinite(post["log_evidence"])
    # one joint posterior: the shared mass and light shapes, the fit's free parameters
    assert len(post["parameters"]) == result["fit"]["n_free"]
    theta = post["parameters"]["mass.components[0].theta_E"]
    assert abs(theta["mean"] - 1.0) < 5 * theta["std"] + 2e-3
    fit_error = result["fit"]["components"][0]["parameters"]["theta_E"]["error"]
    assert 0.5 < theta["std"] / fit_error < 2.0
    # the fit's JSON names each band's light
    sources = [c for c in result["fit"]["components"] if c["field"] == "source"]
    assert [c["band"] for c in sources] == ["G", "R"]
    assert (tmp_path / "bands.nc").stat().st_size > 0
    assert code == (0 if post["n_eff"] >= 0.9 * 400 else 2)
    assert "2 bands: G 50x50 pixels" in capsys.readouterr().out


@pytest.mark.slow
def test_pixelized_fit_of_bands_writes_evidence_per_band(band_file, tmp_path):
    out = tmp_path / "pix.json"
    argv = [
        *_band_args(band_file),
        "--band-pixel-scales", "0.06,0.1",
        "--band-names", "G,R",
        "--mask-radius", "1.4",
        "--lens-light", "sersic",
        "--source", "pixelized",
        "--mesh", "adaptive:12x12",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [b["name"] for b in result["bands"]] == ["G", "R"]
    per_band = [b["log_evidence"] for b in result["bands"]]
    assert np.isclose(sum(per_band), result["log_evidence"], rtol=1e-8)
    assert all(stage["positions_penalty"] == 0.0 for stage in result["stages"])
    sources = [c for c in result["components"] if c["field"] == "source"]
    assert [c["class"] for c in sources] == ["PixelizedSource"] * 2
    # each band's regularization strength is its own, fitted by its evidence
    strengths = [c["parameters"]["regularization.coefficient"] for c in sources]
    assert all(s["value"] > 0 and s["error"] is not None for s in strengths)
    sie = result["components"][0]["parameters"]
    assert abs(sie["theta_E"]["value"] - 1.0) < 0.03
    for name in ("G", "R"):
        assert (tmp_path / f"pix_{name}.png").exists()
        with fits.open(tmp_path / f"pix_{name}_source.fits") as hdul:
            assert np.nanmax(hdul[0].data) > 5 * np.nanmedian(hdul["ERRORS"].data)


def _sample_args(paths, *extra):
    argv = _args(paths)
    return ["sample", *argv[1:], *extra]


@pytest.mark.slow
def test_sample_command_writes_posterior_netcdf_and_corner(fits_files, tmp_path, capsys):
    pytest.importorskip("blackjax")
    pytest.importorskip("arviz")
    out = tmp_path / "post.json"
    argv = _sample_args(fits_files, "--sampler", "nuts", "--chains", "2", "--warmup", "200")
    argv += ["--samples", "300"]
    code = main([*argv, "--json", str(out)])
    result = json.loads(out.read_text())
    post = result["posterior"]
    assert post["chains"] == 2 and post["draws"] == 300
    theta = post["parameters"]["mass.components[0].theta_E"]
    assert theta["p16"] < theta["p50"] < theta["p84"]
    assert abs(theta["mean"] - 1.0) < 5 * theta["std"] + 2e-3
    fit_error = result["fit"]["components"][0]["parameters"]["theta_E"]["error"]
    assert 0.5 < theta["std"] / fit_error < 2.0
    assert (tmp_path / "post.nc").stat().st_size > 0
    assert (tmp_path / "post_corner.png").exists()
    rhat = max(p["rhat"] for p in post["parameters"].values())
    converged = rhat < 1.01 and post["divergent"] == 0
    assert code == (0 if converged else 2)
    if not converged:
        assert "the sampling did not succeed" in capsys.readouterr().err


@pytest.mark.slow
def test_sample_command_nested_pixelized_writes_the_evidence(fits_files, tmp_path, capsys):
    pytest.importorskip("nautilus")
    pytest.importorskip("arviz")
    out = tmp_path / "pix.json"
    # the lens without lens light, its source pixelized (32x32 mesh, the strength fitted)
    # and marginalised by the evidence: the 7 mass parameters (SIE + shear) sampled (the
    # parametric objective is the NUTS test's; the two tests cover both branches of each)
    paths = fits_files | {"image": fits_files["dark"], "noise": fits_files["dark_noise"]}
    argv = _sample_args(paths, "--lens-light", "none", "--sampler", "nested", "--live", "200")
    argv += ["--source", "pixelized", "--mesh", "rectangular", "--samples", "500"]
    argv += ["--prior-width", "5"]
    code = main([*argv, "--json", str(out)])
    result = json.loads(out.read_text())
    post = result["posterior"]
    assert post["sampler"] == "nautilus" and math.isfinite(post["log_evidence"])
    assert 0 < post["log_evidence_error"] < 0.1
    assert len(post["parameters"]) == result["fit"]["n_free"] == 7
    assert all(name.startswith("mass.") for name in post["parameters"])
    # the regularization's strength, fitted by the evidence, is held (no error)
    (pix,) = [c for c in result["fit"]["components"] if c["class"] == "PixelizedSource"]
    strength = pix["parameters"]["regularization.coefficient"]
    assert strength["value"] > 0 and strength["error"] is None
    theta = post["parameters"]["mass.components[0].theta_E"]
    assert theta["p16"] < theta["p50"] < theta["p84"]
    assert abs(theta["mean"] - 1.0) < 5 * theta["std"] + 2e-3
    fit_error = result["fit"]["components"][0]["parameters"]["theta_E"]["error"]
    # the prior box is the fit +- 5 errors, and the posterior is well inside it
    lo, hi = theta["prior"]
    assert hi - lo == pytest.approx(10 * fit_error, rel=1e-6)
    assert 0.5 < theta["std"] / fit_error < 2.0
    assert (tmp_path / "pix.nc").stat().st_size > 0
    assert (tmp_path / "pix_corner.png").exists()
    assert code == (0 if post["n_eff"] >= 0.9 * 500 else 2)
    printed = capsys.readouterr().out
    assert "pixelized source: rectangular mesh" in printed and "log Z" in printed


def test_sample_command_refuses_bad_counts(fits_files, tmp_path, capsys):
    assert main(_sample_args(fits_files, "--live", "3", "--json", str(tmp_path / "x.json"))) == 1
    assert "--live must be between 10 and" in capsys.readouterr().err
    for option in ("--chains", "--samples", "--max-tree-depth", "--networks"):
        argv = _sample_args(fits_files, option, "0", "--json", str(tmp_path / "x.json"))
        assert main(argv) == 1
        assert f"{option} must be between 1 and" in capsys.readouterr().err
    # a pixelized source's mesh is checked before any fitting
    argv = _sample_args(fits_files, "--source", "pixelized", "--mesh", "hexagonal")
    assert main([*argv, "--json", str(tmp_path / "x.json")]) == 1
    assert "--mesh must be one of" in capsys.readouterr().err


# --- every option under hypothesis, with --check (the inputs validated, nothing fitted) ---

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def odd_files(fits_files, tmp_path_factory):
    """Valid and broken inputs for every file option (FITS and positions text)."""
    folder = tmp_path_factory.mktemp("odd")
    paths = dict(fits_files)
    gauss = np.exp(-0.5 * (np.arange(5) - 2.0) ** 2)
    for name, arr in [
        ("psf_even", np.ones((4, 4))),
        ("psf_zero", np.zeros((5, 5))),
        ("psf_negative", -np.outer(gauss, gauss)),
        ("psf_big", np.ones((61, 61))),
        ("mask_full", np.ones((50, 50), dtype=np.int16)),
        ("cube", np.ones((3, 50, 50))),
        ("zero_noise", np.zeros((50, 50))),
    ]:
        paths[name] = str(folder / f"{name}.fits")
        fits.PrimaryHDU(arr).writeto(paths[name])
    paths["empty_hdu"] = str(folder / "empty_hdu.fits")
    fits.PrimaryHDU().writeto(paths["empty_hdu"])
    for name, text in [
        ("pos_good", "0.9 0.3\n-0.8 -0.4\n"),
        ("pos_words", "left image\nright image\n"),
        ("pos_three", "0.1 0.2 0.3\n-0.1 -0.2 -0.3\n"),
        ("pos_nan", "nan 0.3\n-0.8 -0.4\n"),
        ("pos_one", "0.9 0.3\n"),
        ("pos_empty", ""),
        ("not_fits", "SIMPLE = nonsense\n"),
    ]:
        paths[name] = str(folder / f"{name}.txt")
        (folder / f"{name}.txt").write_text(text)
    paths["missing"] = str(folder / "missing.fits")
    paths["folder"] = str(folder)
    return paths


def _ints(lo: int, hi: int):
    return st.integers(lo, hi).map(str)


GARBAGE = st.one_of(
    st.sampled_from(["", "x", "1,5", "nan", "inf", "-inf", "--", "1e999"]),
    st.text(alphabet="abcxyz+:-_ 0123456789.", max_size=12),
)


def _not_number(least: float, most: float = math.inf, integer: bool = False):
    """Strings that are not a number in [least, most] (not an integer where `integer`)."""
    out = [GARBAGE.filter(lambda t: _invalid_number(t, least, integer, most))]
    if least > -math.inf:
        out.append(st.floats(max_value=least, exclude_max=True).map(repr))
    if most < math.inf:
        out.append(st.floats(min_value=most, exclude_min=True).map(repr))
    if integer:
        out.append(st.sampled_from(["1.5", "2.0", "99999999999999999999999"]))
    return st.one_of(out).filter(lambda t: _invalid_number(t, least, integer, most))


def _invalid_number(text: str, least: float, integer: bool = False, most=math.inf) -> bool:
    """Whether `text` is not a number in [`least`, `most`] (an integer where `integer`)."""
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        return True
    return not (math.isfinite(value) and least <= value <= most)


def _positive():
    return st.one_of(st.sampled_from(["0", "-0.0", "-1"]), _not_number(0.0)).filter(
        lambda t: _invalid_number(t, 0.0) or float(t) <= 0
    )


#: Per option of `fit` (one image) and `sample`: (valid values, invalid values, words one of
#: which the refusal must name). File options hold names of `odd_files`.
OPTIONS = {
    "IMAGE": (
        st.sampled_from(["image", "dark"]),
        st.sampled_from(["nan", "small", "cube", "empty_hdu", "not_fits", "missing", "folder"]),
        ("image", "data"),
    ),
    "--noise-map": (
        st.just("noise"),
        st.sampled_from(["zero_noise", "small", "cube", "missing", "not_fits", "nan"]),
        ("noise",),
    ),
    "--psf": (
        st.just("psf"),
        st.sampled_from(["psf_even", "psf_zero", "psf_negative", "psf_big", "cube", "missing"]),
        ("psf", "PSF"),
    ),
    "--pixel-scale": (st.sampled_from(["0.06", "0.05", "0.08"]), _positive(), ("pixel-scale",)),
    "--mask": (
        st.just("mask"),
        st.sampled_from(["mask_full", "small", "folder", "not_fits", "missing"]),
        ("mask",),
    ),
    "--mask-radius": (st.sampled_from(["1.0", "1.4", "100"]), _positive(), ("mask-radius",)),
    "--mass": (
        st.sampled_from(["sie+shear", "epl+shear", "sis", "nfw+sie", "SIE + shear", "enfw"]),
        st.sampled_from(["sie+banana", "+", "", "sie++shear", "shear+"]),
        ("mass",),
    ),
    "--lens-light": (
        st.sampled_from(["mge", "sersic", "none", "None", "sersic+sersic", "mge+mge"]),
        st.sampled_from(["blob", "", "sersic+", "pixelized"]),
        ("lens light", "lens-light"),
    ),
    "--source": (
        st.sampled_from(["sersic", "pixelized", "Pixelized", "gaussian", "sersic+sersic"]),
        st.sampled_from(["blob", "", "+", "pixelised"]),
        ("source",),
    ),
    "--mesh": (
        st.sampled_from(["rectangular", "adaptive:12x12", "delaunay:50", "rectangular:20X20"]),
        st.sampled_from(
            [
                "hexagonal",
                "",
                "rectangular:0x4",
                "rectangular:3x3x3",
                "adaptive:-2x5",
                "delaunay:-3",
                "delaunay:x",
                "adaptive:12",
            ]
        ),
        ("mesh",),
    ),
    "--regularization": (
        st.sampled_from(REGULARIZATIONS),
        st.sampled_from(["tv", "", "Constant "]),
        ("regularization",),
    ),
    "--regularization-strength": (
        st.sampled_from(["2.0", "1e-3"]),
        _positive(),
        ("regularization-strength",),
    ),
    "--supersampling": (_ints(1, 4), _not_number(1, 32, True), ("supersampling",)),
    "--solver": (
        st.sampled_from(["lm", "bfgs", "LBFGS", "adam", "nonlinear-cg"]),
        st.sampled_from(["newton", "", "l-bfgs"]),
        ("solver",),
    ),
    "--max-steps": (_ints(1, 1000), _not_number(1, 2**31 - 1, True), ("max-steps",)),
    "--positions": (
        st.just("pos_good"),
        st.sampled_from(["pos_words", "pos_three", "pos_nan", "pos_one", "pos_empty", "missing"]),
        ("positions",),
    ),
    "--positions-sigma": (st.sampled_from(["0.05", "0.2"]), _positive(), ("positions-sigma",)),
}
SAMPLE_OPTIONS = {
    "--sampler": (
        st.sampled_from(["auto", "nuts", "nested"]),
        st.sampled_from(["emcee", ""]),
        ("sampler",),
    ),
    "--chains": (_ints(1, 8), _not_number(1, 2**31 - 1, True), ("chains",)),
    "--max-tree-depth": (_ints(1, 20), _not_number(1, 20, True), ("max-tree-depth",)),
    "--warmup": (_ints(0, 1000), _not_number(0, 2**31 - 1, True), ("warmup",)),
    "--samples": (_ints(1, 2000), _not_number(1, 2**31 - 1, True), ("samples",)),
    "--live": (_ints(10, 2000), _not_number(10, 2**31 - 1, True), ("live",)),
    "--networks": (_ints(1, 64), _not_number(1, 64, True), ("networks",)),
    "--prior-width": (st.sampled_from(["10", "3.5"]), _positive(), ("prior-width",)),
    "--seed": (_ints(0, 2**32 - 1), _not_number(0, 2**32 - 1, True), ("seed",)),
}
FILE_OPTIONS = {"IMAGE", "--noise-map", "--psf", "--mask", "--positions"}
REQUIRED = ("IMAGE", "--noise-map", "--psf", "--pixel-scale")
PIXELIZED_ONLY = ("--mesh", "--regularization", "--regularization-strength")


def _run_checked(argv: list[str]) -> tuple[int, str, str]:
    """`main(argv)`'s status, stdout and stderr; argparse's own refusals (status 2) too.
    Any exception escaping `main` fails the test: the command must never show a
    traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse: usage and one error line
            code = stop.code if isinstance(stop.code, int) else 1
            assert code == 2 and "error:" in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", ["fit", "sample"])
def test_every_option_is_checked_where_it_enters(odd_files, tmp_path, command):
    """`equilens fit|sample ... --check` over every option: any combination of valid
    values is accepted (status 0, a summary, nothing written); one invalid value (out of
    range, garbage, a broken or missing file) is refused with one line that names the
    option (argparse's own refusals: status 2 and its usage). Never a traceback."""
    options = OPTIONS | (SAMPLE_OPTIONS if command == "sample" else {})
    optional = [k for k in options if k not in REQUIRED]

    @FUZZ
    @given(data=st.data())
    def check(data):
        present = data.draw(st.sets(st.sampled_from(optional)), label="options")
        values = {k: data.draw(options[k][0], label=k) for k in (*REQUIRED, *sorted(present))}
        pixelized = values.get("--source", "sersic").lower() == "pixelized"
        if not pixelized:  # (a pixelized source's options alone are refused: a bad case)
            values = {k: v for k, v in values.items() if k not in PIXELIZED_ONLY}
        if "--positions" not in values:
            values.pop("--positions-sigma", None)
        names = st.sampled_from(sorted(values))
        bad = data.draw(st.one_of(st.none(), names, names, names), label="bad")
        if bad is not None:
            values[bad] = data.draw(options[bad][1], label=f"bad {bad}")
        argv = [command, odd_files[values.pop("IMAGE")]]
        for option, value in values.items():
            argv += [option, odd_files[value] if option in FILE_OPTIONS else value]
        argv += ["--json", str(tmp_path / "out.json"), "--check"]
        code, out, err = _run_checked(argv)
        assert "Traceback" not in err
        assert not (tmp_path / "out.json").exists()  # nothing fitted, nothing written
        if bad is None:
            assert code == 0, (argv, err)
            assert "the inputs are valid" in out
            event("accepted")
            return
        assert code != 0, (bad, argv, out)
        line = err.strip().splitlines()[-1]
        if code == 1:
            assert err.strip() == line and line.startswith("equilens: error:"), (argv, err)
        path = odd_files.get(values.get(bad, ""), "\0")
        named = any(word in line for word in options[bad][2]) or path in line
        assert named, (bad, argv, line)
        event(f"refused: {bad}")

    check()


def test_default_mesh_fits_the_mask():
    from equilens.cli import DEFAULT_MESH, default_mesh, make_mesh

    grid = el.Grid((80, 80), pixel_scale=0.1)
    psf = el.GaussianPSF(fwhm=0.2, pixel_scale=0.1)

    def imaging(radius):
        data = np.ones(grid.shape)
        return el.Imaging(data, data, psf, 0.1, mask=grid.circular_mask(radius))

    assert default_mesh(imaging(3.0)) == DEFAULT_MESH  # 2,821 pixels
    small = imaging(1.7)  # 901 pixels: at most 450 source pixels, 21x21
    n = int(np.asarray(small.mask).sum())
    assert default_mesh(small) == "adaptive:21x21" and 21**2 <= n / 2 < 22**2
    assert make_mesh(default_mesh(small), small).n_pixels == 441
    with pytest.raises(ValueError, match="too few for a pixelized source"):
        default_mesh(imaging(0.6))
    # `equilens subhalo`'s default: the same sizes, adapted to the brightness too
    assert default_mesh(imaging(3.0), "brightness") == "brightness:32x32"
    assert default_mesh(small, "brightness") == "brightness:21x21"
    bright = make_mesh("brightness:21x21", small)
    assert isinstance(bright, el.AdaptiveRectangularMesh) and bright.uses_signal
    assert bright.shape == (21, 21) and bright.weight_floor == 0.1
    assert not make_mesh("adaptive", small).uses_signal
    with pytest.raises(ValueError, match="--mesh must be one of"):
        make_mesh("bright:20x20", small)


def _subhalo_args(paths, *extra):
    return [
        "subhalo",
        paths["image"],
        "--noise-map",
        paths["noise"],
        "--psf",
        paths["psf"],
        "--pixel-scale",
        "0.06",
        "--mask-radius",
        "1.4",
        "--z-lens",
        "0.3",
        "--z-source",
        "1.2",
        *extra,
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--z-lens", "1.5"), "0 < z_lens < z_source"),
        (("--grid", "0"), "--grid must be between 1 and"),
        (("--source", "blob"), "--source must be pixelized or sersic"),
        (("--mass", "sie+banana"), "unknown mass profile 'banana'"),
        (("--band", "a", "b", "c"), "one image"),
        (("--source", "sersic", "--mesh", "adaptive"), "--mesh is an option of --source pixelized"),
        (("--workers", "0"), "--workers must be between 1 and"),
        (("--refine", "1"), "--refine must be 0 (none) or between 2 and"),
        (("--start-grid", "-1"), "--start-grid must be between 0 and"),
        (("--polish", "1"), "--polish must be 0 (none) or between 2 and"),
        (("--held-cells", "-1"), "--held-cells must be between 0 and"),
        (("--held-below", "0"), "--held-below must be > 0"),
        (("--held-below", "nan"), "--held-below must be > 0"),
        (("--searched-cells", "-1"), "--searched-cells must be between 0 and"),
        (("--smooth-starts", "-2"), "--smooth-starts must be between 0 and"),
        (("--finer-meshes", "-1"), "--finer-meshes must be between 0 and"),
        (("--fit-tolerance", "-1"), "--fit-tolerance must be >= 0"),
        (("--fit-tolerance", "nan"), "--fit-tolerance must be >= 0"),
        (("--scheduler", "tcp://127.0.0.1:9", "--workers", "2"), "exclude each other"),
    ],
)
def test_subhalo_bad_input_is_one_line_and_nonzero(fits_files, tmp_path, capsys, extra, message):
    code = main([*_subhalo_args(fits_files, *extra), "--json", str(tmp_path / "s.json")])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith("equilens: error:") and "\n" not in err, err
    assert message in err, err


def test_subhalo_held_options_reach_the_scan(fits_files, tmp_path, monkeypatch):
    """`--held-cells`, `--held-below` and `--searched-cells` are passed on to `run_subhalo`
    as given, `inf` included (every one of the best cells fitted again)."""
    from equilens.cli import _main

    seen = {}

    def recorded(imaging, out, z_lens, z_source, **kw):
        seen.update(kw)
        return {"status": "successful"}

    monkeypatch.setattr(_main, "run_subhalo", recorded)
    argv = _subhalo_args(fits_files, "--held-cells", "2", "--held-below", "inf")
    argv += ["--searched-cells", "0"]
    assert main([*argv, "--json", str(tmp_path / "s.json")]) == 0
    assert seen["held_cells"] == 2 and seen["held_below"] == math.inf
    assert seen["searched_cells"] == 0
    argv = _subhalo_args(fits_files)
    assert main([*argv, "--json", str(tmp_path / "s.json")]) == 0
    assert seen["held_cells"] == 3 and seen["held_below"] == 100.0
    assert seen["searched_cells"] == 3


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--subhalo", "--workers", "0"), "--workers must be between 1 and"),
        (("--workers", "2"), "--workers applies to demo --subhalo"),
    ],
)
def test_demo_workers_are_checked_before_anything_runs(tmp_path, capsys, extra, message):
    assert main(["demo", "--output", str(tmp_path), *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("equilens: error:") and "\n" not in err and message in err, err
    assert list(tmp_path.iterdir()) == []  # nothing fitted, nothing written


def test_the_kept_smooth_model_is_read_back_only_for_its_own_data_and_settings(tmp_path):
    from equilens.cli._kept import fingerprint, read_smooth, write_smooth

    grid = el.Grid((30, 30), pixel_scale=0.1)
    psf = el.GaussianPSF(fwhm=0.2, pixel_scale=0.1)

    def imaging(data):
        return el.Imaging(data, np.ones(grid.shape), psf, 0.1, mask=grid.circular_mask(1.2))

    data = np.random.default_rng(0).normal(size=grid.shape)
    settings = {"mass": "sie+shear", "regularization": "adaptive", "strength": None}
    key = fingerprint(imaging(data), settings)
    # rebuilt from the same numbers: the same key; a pixel, a setting, the mask: another
    assert fingerprint(imaging(data.copy()), dict(settings)) == key
    other = data.copy()
    other[15, 15] += 1e-9
    assert fingerprint(imaging(other), settings) != key
    assert fingerprint(imaging(data), {**settings, "strength": 1.0}) != key
    wider = el.Imaging(data, np.ones(grid.shape), psf, 0.1, mask=grid.circular_mask(1.3))
    assert fingerprint(wider, settings) != key

    path = str(tmp_path / "scan_smooth.pkl")
    assert read_smooth(path, key) == (None, "no kept smooth model")
    source = light.Sersic(amp=2.0, R_sersic=0.2, n_sersic=1.0)
    model = el.LensSystem(mass=mass.SIE(theta_E=1.1), source=source)
    adapt = np.arange(6.0)
    write_smooth(path, key, model, adapt)
    kept, why = read_smooth(path, key)
    assert kept is not None and why == f"read from {path}"
    back, back_adapt = kept
    assert jax.tree.structure(back) == jax.tree.structure(model)
    pairs = zip(jax.tree.leaves(back), jax.tree.leaves(model), strict=True)
    assert all(np.array_equal(a, b) for a, b in pairs)
    np.testing.assert_array_equal(back_adapt, adapt)
    assert read_smooth(path, "another key") == (
        None,
        f"{path} is of other data or settings: fitting it again",
    )
    with open(path, "r+b") as f:  # damaged: fitted again, never an error
        f.truncate(20)
    kept, why = read_smooth(path, key)
    assert kept is None and "could not be read" in why


def test_subhalo_commands_pixelized_chain_leaves_the_errors_to_the_scan(monkeypatch):
    """`equilens subhalo`'s smooth model: the pixelized chain without its last stage's
    errors (`fit_pixelized(covariance=False)`: the scan's Laplace evidence gives them,
    `smooth_errors`); `equilens fit`'s chain keeps them."""
    import equilens.solve
    from equilens.cli import _source, _subhalo

    class Stop(Exception):
        pass

    seen = []

    def recorded(imaging, start, **kw):
        seen.append(kw.get("covariance", True))
        raise Stop

    start = el.LensSystem(
        mass=mass.SIE(theta_E=1.0), source=light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0)
    )
    monkeypatch.setattr(equilens.solve, "fit_pixelized", recorded)
    monkeypatch.setattr(equilens.solve, "auto_positions", lambda *a: None)
    monkeypatch.setattr(_subhalo, "parametric_fit", lambda *a, **kw: SimpleNamespace(model=start))
    mesh, reg = el.RectangularMesh((8, 8)), el.ConstantRegularization(1.0)
    with pytest.raises(Stop):
        _subhalo._smooth_fit(
            None, "sie", None, "lm", None, mesh, reg, None, False, None, source="pixelized"
        )
    with pytest.raises(Stop):
        _source._pixelized_stage(
            None, SimpleNamespace(model=start), mesh, reg, None, "lm", None, None, False
        )
    assert seen == [False, True]


@slow_ci
def test_subhalo_command_writes_the_map_and_finds_nothing_in_a_smooth_lens(
    fits_files, tmp_path, capsys
):
    pytest.importorskip("distributed")
    out = tmp_path / "scan.json"
    argv = _subhalo_args(
        fits_files,
        "--lens-light",
        "sersic",
        "--source",
        "sersic",
        "--grid",
        "2",
        "--kind",
        "pseudo_jaffe",
        "--workers",  # the cells on a local Dask cluster (the extra `cluster`)
        "2",
        "--refine",
        "2",
        "--start-grid",  # each cell also from the best of its 2 x 2 x 8 start grid
        "2",
        "--polish",  # the best model fitted again over its cell, from a 2 x 2 x 8 grid
        "2",
        "--held-cells",  # the best cell fitted once more, its subhalo's mass held first
        "1",
        "--searched-cells",  # and once more from a global search with a parametric source
        "1",
    )
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    best = result["best"]
    for key in ("center_x", "center_y", "mass_within_1kpc", "delta_log_evidence", "log10_mass"):
        assert key in best
    cells = result["cells"]
    assert len(cells) == 4 and all(c["status"] == "successful" for c in cells)
    # a lens simulated without a subhalo: no cell's evidence says there is one
    assert max(c["delta_log_evidence"] for c in cells) < 5
    # the best cell refined by 2 x 2 sub-cells: nothing there either; best is its best
    refined = result["refinement"]
    subs = refined["sub_cells"]
    assert len(subs) == 4 and all(c["status"] == "successful" for c in subs)
    assert (
        max(c["delta_log_evidence"] for c in cells) == cells[refined["cell"]]["delta_log_evidence"]
    )
    assert max(c["delta_log_evidence"] for c in subs) < 5
    # the polishing fit over the refined cell: nothing either; best the better of the two
    polished = result["polished"]
    assert polished["cell"] == refined["cell"] and polished["status"] == "successful"
    assert polished["delta_log_evidence"] < 5
    assert best["delta_log_evidence"] == max(
        polished["delta_log_evidence"], *(c["delta_log_evidence"] for c in subs)
    )
    assert best["polished"] == polished["chosen"]
    assert result["z_lens"] == 0.3 and "x grows with the column index" in result["convention"]
    assert result["held"] == []  # (a parametric source: nothing held)
    assert (tmp_path / "scan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the header, 4 cells, the held-mass fit, the searched fit, 4 sub-cells, the polishing
    # fit and the smooth model's 3 refits (--smooth-starts 3)
    lines = (tmp_path / "scan_cells.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 4 + 1 + 1 + 4 + 1 + 3
    assert sum('"held"' in line for line in lines[1:]) == 1
    assert sum('"searched"' in line for line in lines[1:]) == 1

    # run again: the smooth model is read back from scan_smooth.pkl (not fitted again) and
    # every cell and sub-cell resumed from the cells' file: the same scan
    capsys.readouterr()
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"smooth model: read from {tmp_path / 'scan_smooth.pkl'}" in printed
    assert "stage 2" not in printed  # (no parametric fit)
    again = json.loads(out.read_text())
    assert again["smooth_log_evidence"] == result["smooth_log_evidence"]
    assert [c["log_evidence"] for c in again["cells"]] == [c["log_evidence"] for c in cells]
    assert again["best"] == best
    assert len((tmp_path / "scan_cells.jsonl").read_text().splitlines()) == len(lines)


@slow_ci
def test_subhalo_scheduler_connects_by_address_or_file_and_refuses_a_silent_one(tmp_path):
    distributed = pytest.importorskip("distributed")
    from equilens.cli._subhalo import dask_client

    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
    ) as cluster:
        address = cluster.scheduler_address
        with dask_client(address, 1) as client:
            assert client.scheduler.address == address
            assert len(client.scheduler_info()["workers"]) == 1
        file = tmp_path / "scheduler.json"
        file.write_text(json.dumps({"address": address}))
        with dask_client(str(file), 1) as client:
            assert client.scheduler.address == address
    with dask_client(None, 1) as client:
        assert client is None
    with pytest.raises(ValueError, match="no Dask scheduler answered"):
        with dask_client("tcp://127.0.0.1:9", 1):
            pass
