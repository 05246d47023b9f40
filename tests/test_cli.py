"""The `equilens` command."""

import os

import numpy as np
import pytest
from astropy.io import fits

from equilens.cli import main


def test_demo_writes_png_and_fits(tmp_path):
    assert main(["demo", "--output", str(tmp_path), "--seed", "3"]) == 0
    png = tmp_path / "demo.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = fits.getdata(tmp_path / "demo.fits")
    assert data.shape == (100, 100)
    # a lens: the brightest pixel is the lens galaxy at the centre, and the ring is there
    i, j = np.unravel_index(np.argmax(data), data.shape)
    assert abs(i - 49.5) < 3 and abs(j - 49.5) < 3
    assert os.path.getsize(png) > 10_000


def test_unknown_command_exits_nonzero():
    with pytest.raises(SystemExit) as err:
        main(["nonsense"])
    assert err.value.code != 0
