"""The checks of `fit`'s and `sample`'s options, before any fitting (`--check` prints
what they found)."""

import math
from typing import Any

from ._source import default_mesh, make_mesh, make_regularization

MAX_SUPERSAMPLING = 32  # sub-pixels per pixel side: beyond it a typo, not a model
MAX_COUNT = 2**31 - 1  # steps, chains, draws, live points: int32 on the device


def _lens_light(args) -> str | None:
    return None if args.lens_light.lower() == "none" else args.lens_light


def _check_solver(name: str) -> None:
    from ..solve import SOLVER_NAMES

    if name.lower() not in SOLVER_NAMES:
        raise ValueError(f"--solver must be one of {', '.join(SOLVER_NAMES)}, got {name!r}")


def _check_numbers(args) -> None:
    """The counts and numbers of `fit`'s and `sample`'s options, before any file is read."""
    if not 1 <= args.supersampling <= MAX_SUPERSAMPLING:
        raise ValueError(
            f"--supersampling must be between 1 and {MAX_SUPERSAMPLING}, got {args.supersampling}"
        )
    if args.max_steps is not None and not 1 <= args.max_steps <= MAX_COUNT:
        raise ValueError(f"--max-steps must be between 1 and {MAX_COUNT}, got {args.max_steps}")
    _check_solver(args.solver)
    if args.positions_sigma is not None:
        if args.positions is None:
            raise ValueError("--positions-sigma needs --positions")
        if not (math.isfinite(args.positions_sigma) and args.positions_sigma > 0):
            raise ValueError(f"--positions-sigma must be > 0 arcsec, got {args.positions_sigma}")
    pixelized = args.source == "pixelized"
    for option, value in (
        ("--mesh", args.mesh),
        ("--regularization", args.regularization),
        ("--regularization-strength", args.regularization_strength),
    ):
        if value is not None and not pixelized:
            raise ValueError(f"{option} is an option of --source pixelized (got {args.source})")
    if args.power_law and not pixelized:
        raise ValueError(f"--power-law is an option of --source pixelized (got {args.source})")
    if args.power_law and args.band:
        raise ValueError("--power-law is an option of one band's pixelized chain, not --band")
    if args.command != "sample":
        return
    for option, value, least, most in (
        ("--chains", args.chains, 1, MAX_COUNT),
        ("--warmup", args.warmup, 0, MAX_COUNT),
        ("--samples", 1 if args.samples is None else args.samples, 1, MAX_COUNT),
        ("--live", args.live, 10, MAX_COUNT),
        ("--networks", args.networks, 1, 64),
        ("--max-tree-depth", 1 if args.max_tree_depth is None else args.max_tree_depth, 1, 20),
        ("--seed", args.seed, 0, 2**32 - 1),
    ):
        if not least <= value <= most:
            raise ValueError(f"{option} must be between {least} and {most}, got {value}")
    if not (math.isfinite(args.prior_width) and args.prior_width > 0):
        raise ValueError(f"--prior-width must be > 0 (errors of the fit), got {args.prior_width}")


def _class_names(node: Any) -> str:
    """`SIE + ExternalShear` for a sum of profiles, the class name for one."""
    from ..light import LightSum
    from ..mass import MassSum

    parts = node.components if isinstance(node, MassSum | LightSum) else (node,)
    return " + ".join(type(p).__name__ for p in parts)


def _check_model(args, imaging, positions) -> list[str]:
    """The model options of `fit` and `sample` checked on `imaging` (the first band) before
    any fitting: the profile names (the starting model is built), the positions, a
    pixelized source's mesh and regularization. Returns what would be fitted, in words."""
    import equinox as eqx
    import jax
    import numpy as np

    from ..solve import as_power_law, start_model

    pixelized = args.source == "pixelized"
    lens_light = _lens_light(args)
    model = start_model(imaging, args.mass, lens_light, "sersic" if pixelized else args.source)
    n_used = int(np.asarray(imaging.mask).sum())
    n_params = sum(
        np.size(leaf) for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    )
    if n_used <= n_params:
        raise ValueError(
            f"the mask leaves {n_used} pixels to fit, not more than the model's {n_params} "
            "parameters (a larger --mask-radius?)"
        )
    lines = [
        f'data: {imaging.shape[0]}x{imaging.shape[1]} pixels of {imaging.pixel_scale:g}" '
        f"({n_used} in the mask), supersampling {imaging.grid.supersampling}",
        "model: "
        + ", ".join(
            f"{field.replace('_', ' ')} {_class_names(getattr(model, field))}"
            for field in ("mass", "lens_light", "source")
            if getattr(model, field) is not None
        ),
        f"solver: {args.solver}",
    ]
    if positions is not None:
        lines.append(f"positions: {len(positions)} images")
    if args.command == "fit" and not args.band and args.mask_radius is not None:
        lines.append(
            "mask: kept as given (--fixed-mask)"
            if args.fixed_mask
            else "mask: grown onto arcs that continue beyond it, after the parametric fit"
        )
    if pixelized:
        power_stage = args.power_law and not args.band and as_power_law(model) is not None
        name = "constant" if args.regularization is None else args.regularization
        mesh = make_mesh(default_mesh(imaging) if args.mesh is None else args.mesh, imaging)
        make_regularization(name, args.regularization_strength)
        lines.append(
            f"pixelized source: {type(mesh).__name__} ({mesh.n_pixels} pixels), {name} "
            "regularization" + ("; then the power-law stage" if power_stage else "")
        )
    return lines
