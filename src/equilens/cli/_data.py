"""The data of `fit` and `sample`: one image (`_imaging`), or `--band` once per band
(`_bands`), and the `--positions` file."""

import math
import os
import warnings
from typing import Any


def _load(
    image: str,
    noise_map: str,
    psf: str,
    pixel_scale: float,
    exclude: str | None,
    radius: float | None,
    supersampling: int,
):
    from .. import Imaging

    if not (math.isfinite(pixel_scale) and pixel_scale > 0):
        raise ValueError(f"--pixel-scale must be > 0 arcsec, got {pixel_scale}")
    if radius is not None and not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"--mask-radius must be > 0 arcsec, got {radius}")
    # the radius joins the mask before the data are checked: only the pixels the fit uses
    # must be finite with positive noise (a cutout's NaN border outside it is ignored)
    full = Imaging.from_fits(
        image,
        noise_map,
        psf,
        pixel_scale,
        exclude_mask=exclude,
        supersampling=supersampling,
        mask_radius=radius,
    )
    if full.ignored_bad_pixels:
        print(
            f"  {image}: {full.ignored_bad_pixels} bad pixels (NaN, inf or noise <= 0) "
            "outside the mask, ignored"
        )
    return full.cropped()


def _region(
    image: str,
    noise_map: str,
    psf: str,
    pixel_scale: float,
    exclude: str | None,
    supersampling: int,
):
    """The whole image's usable pixels (finite, with positive noise, not excluded by the
    user): where `fit` grows its mask to arcs that continue beyond it
    (`equilens.solve.fit_to_arcs`)."""
    from .. import Imaging
    from ..data import DataWarning

    with warnings.catch_warnings():  # (the fit's own pixels were checked by `_load`)
        warnings.simplefilter("ignore", DataWarning)
        return Imaging.from_fits(
            image,
            noise_map,
            psf,
            pixel_scale,
            exclude_mask=exclude,
            supersampling=supersampling,
            exclude_bad=True,
        )


def _positions(path: str | None):
    """The `--positions` file: two columns, x and y in arcsec ('#' starts a comment)."""
    if path is None:
        return None
    import numpy as np

    from ..solve._pipeline import _checked_positions

    if not os.path.exists(path):
        raise ValueError(f"positions file not found: {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy only warns about an empty file
            pos = np.loadtxt(path, ndmin=2)
    except (ValueError, UserWarning) as err:
        raise ValueError(f"cannot read --positions {path}: {err}") from None
    try:
        return _checked_positions(pos)
    except ValueError as err:
        raise ValueError(f"--positions {path}: two columns (x y), >= 2 rows: {err}") from None


def _imaging(args) -> Any:
    """The one-image dataset of `fit`'s and `sample`'s arguments."""
    return _load(
        args.image,
        args.noise_map,
        args.psf,
        args.pixel_scale,
        args.mask,
        args.mask_radius,
        args.supersampling,
    )


def _grow_region(args) -> Any:
    """`_region` of `fit`'s one image when its mask may grow: a `--mask-radius` given (else
    the mask already holds every usable pixel) and no `--fixed-mask`; else None."""
    if args.mask_radius is None or getattr(args, "fixed_mask", True):
        return None
    return _region(
        args.image, args.noise_map, args.psf, args.pixel_scale, args.mask, args.supersampling
    )


def _bands(args):
    """The `--band IMAGE NOISE PSF` options as a `MultiBandImaging`."""
    from ..data import MultiBandImaging

    if args.image is not None or args.noise_map is not None or args.psf is not None:
        raise ValueError("give either IMAGE with --noise-map and --psf, or --band once per band")
    n = len(args.band)
    names = [f"band{k}" for k in range(n)]
    if args.band_names is not None:
        names = [v.strip() for v in args.band_names.split(",")]
        if len(names) != n:
            raise ValueError(f"--band-names lists {len(names)} names for {n} bands")
    if args.band_pixel_scales is not None:
        try:
            scales = [float(v) for v in args.band_pixel_scales.split(",")]
        except ValueError:
            raise ValueError(
                f"--band-pixel-scales must be numbers, got {args.band_pixel_scales!r}"
            ) from None
        if len(scales) != n:
            raise ValueError(f"--band-pixel-scales lists {len(scales)} scales for {n} bands")
    elif args.pixel_scale is not None:
        scales = [args.pixel_scale] * n
    else:
        raise ValueError("give --pixel-scale (all bands) or --band-pixel-scales (one per band)")
    bands = []
    for name, (image, noise, psf), scale in zip(names, args.band, scales, strict=True):
        try:
            bands.append(
                _load(image, noise, psf, scale, args.mask, args.mask_radius, args.supersampling)
            )
        except ValueError as err:
            raise ValueError(f"band {name}: {err}") from None
    return MultiBandImaging(bands, names)
