"""The parametric fit that `equilens fit` and `equilens sample` start with."""

from collections.abc import Callable
from typing import Any


def parametric_fit(
    fit_fn: Callable[..., Any],
    data: Any,
    mass: str,
    lens_light: str | None,
    source: str,
    *,
    pixelized: bool,
    solver: str,
    max_steps: int | None,
    positions: Any,
    positions_sigma: float | None,
    progress: bool,
    partial: Any,
    minima: list | None = None,
) -> Any:
    """`fit_fn` (`equilens.solve.fit_lens` for one image, `fit_multiband` for several
    bands) as the commands run it: 300 steps per fit unless `max_steps` is given, each
    finished stage kept by `partial` (an interrupted run writes it), and for a pixelized
    source one Sersic (the pixelized chain that follows describes the source itself, so
    the second Sersic component is not tried). `minima`, a list, receives the search's
    refined minima (`fit_lens`'s `on_minima`; one image only): the pixelized chain's
    other starts (`_pixelized_stage`'s `alternatives`)."""
    extra = {} if minima is None else {"on_minima": minima.extend}
    return fit_fn(
        data,
        mass,
        lens_light,
        "sersic" if pixelized else source,
        solver=solver,
        max_steps=300 if max_steps is None else max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        progress=progress,
        on_stage=None if partial is None else partial.keep,
        second_source=not pixelized,
        **extra,
    )
