"""Several bands of one lens: a tuple of `Imaging` datasets with names."""

from collections.abc import Sequence

import equinox as eqx

from ._imaging import Imaging


class MultiBandImaging(eqx.Module):
    """The images of one lens in several bands (or epochs, or instruments): each an
    `Imaging` with its own data, noise, PSF, mask, pixel scale and supersampling.

    All bands share one sky frame: a band's `Imaging.origin` is the sky position (arcsec,
    in the reference frame of the model) of its array centre, so bands whose cutouts are
    offset from each other (different pointings, a registration offset measured from the
    WCS) each carry their own origin; `offsets` adds `(dx, dy)` arcsec per band to them.

    **Arguments:** `bands` (a sequence of `Imaging`); `names` (one per band, unique;
    default "band0", "band1", ...); `offsets` (optional, one `(dx, dy)` per band).
    """

    bands: tuple[Imaging, ...]
    names: tuple[str, ...] = eqx.field(static=True)

    def __init__(
        self,
        bands: Sequence[Imaging],
        names: Sequence[str] | None = None,
        offsets: Sequence[tuple[float, float]] | None = None,
    ):
        bands = tuple(bands)
        if not bands:
            raise ValueError("MultiBandImaging needs at least one band")
        for i, b in enumerate(bands):
            if not isinstance(b, Imaging):
                raise TypeError(f"MultiBandImaging band {i} must be an Imaging, got {type(b)}")
        names = tuple(f"band{i}" for i in range(len(bands))) if names is None else tuple(names)
        if len(names) != len(bands):
            raise ValueError(f"{len(names)} names for {len(bands)} bands")
        if len(set(names)) != len(names):
            raise ValueError(f"band names must be unique, got {names}")
        if offsets is not None:
            offsets = tuple(offsets)
            if len(offsets) != len(bands):
                raise ValueError(f"{len(offsets)} offsets for {len(bands)} bands")
            bands = tuple(
                b.shifted(float(dx), float(dy)) for b, (dx, dy) in zip(bands, offsets, strict=True)
            )
        self.bands = bands
        self.names = names

    def __len__(self) -> int:
        return len(self.bands)

    def __getitem__(self, i: int) -> Imaging:
        return self.bands[i]
