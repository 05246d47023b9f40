"""Lensing quantities of any mass model: ray shooting, magnification, critical curves,
caustics and the multiple images of a source point."""

from ._critical import (
    caustics as caustics,
    critical_curves as critical_curves,
    source_plane_lines as source_plane_lines,
)
from ._images import (
    image_positions as image_positions,
    solve_lens_equation as solve_lens_equation,
)
