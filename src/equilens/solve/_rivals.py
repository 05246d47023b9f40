"""Rival minima: other minima of a fit that explain the data as well as the chosen one with
another Einstein radius, reported beside it rather than dropped silently."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..objective import Objective
from ._fit import fit
from ._result import RESULTS, FitResult
from ._search import first_mass
from ._solvers import SolverLike

#: A minimum is a rival of the chosen one when its objective (minus the log-likelihood, or
#: minus the log-evidence: natural-log units) is within `RIVAL_TOLERANCE` of the chosen
#: one's ...
RIVAL_TOLERANCE = 5.0
#: ... and its Einstein radius differs by more than this fraction (the accuracy the
#: validation asks of a fit).
RIVAL_THETA_E = 0.01
#: At most this many candidates are refined (each one fit of the last stage).
MAX_RIVALS = 2
#: How a rival minimum's note in `FitResult.notes` begins.
RIVAL_NOTE = "a rival minimum fits as well"


def _theta_e(model: Any) -> float:
    _, first = first_mass(model)
    return float(first.theta_E)


def _distinct(theta: float, taken: Sequence[float]) -> bool:
    return all(abs(theta / t - 1.0) > RIVAL_THETA_E for t in taken)


def with_rival_minima(
    objective: Objective,
    chosen: FitResult,
    candidates: Sequence[FitResult],
    *,
    solver: SolverLike = "lm",
    free: Any = None,
    bounds: Any = None,
    max_steps: int = 300,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    candidates_reference: float | None = None,
) -> tuple[FitResult, tuple[FitResult, ...]]:
    """Checks `chosen` (a converged fit of `objective`) against other minima of it.

    `candidates` are the other ends of a search (e.g. the refined starts of
    `equilens.solve.search`, less polished than `chosen`): those whose Einstein radius
    (the first mass component's `theta_E`) differs from the chosen one's by more than
    `RIVAL_THETA_E` and whose objective is within twice `RIVAL_TOLERANCE` of
    `candidates_reference` (the chosen minimum's objective where the candidates were
    evaluated, e.g. a search's cheaper objective; default `chosen.value`), one per
    distinct radius and at most `MAX_RIVALS`, are fitted again as `chosen` was
    (`objective`, `solver`, `free`, `bounds`, `max_steps`). A refitted candidate that converges
    to a plausible model within `RIVAL_TOLERANCE` of the chosen one's objective, its
    Einstein radius still that far off, is a rival: the data do not decide between them.
    One that ends lower takes the chosen one's place (refitted with its covariance).

    Returns the chosen result (its status `RESULTS.ambiguous` when it has rivals, each
    named in `notes` with its Einstein radius and objective; a status that was not
    successful is kept, the notes added) and the rivals' results."""
    say = log or (lambda _: None)
    theta = _theta_e(chosen.model)
    reference = float(chosen.value)
    screen = reference if candidates_reference is None else float(candidates_reference)
    picked: list[FitResult] = []
    taken = [theta]
    for cand in sorted(candidates, key=lambda c: float(c.value)):
        value = float(cand.value)
        t = _theta_e(cand.model)
        if not np.isfinite(value) or value - screen > 2 * RIVAL_TOLERANCE:
            continue
        if _distinct(t, taken):
            picked.append(cand)
            taken.append(t)
        if len(picked) == MAX_RIVALS:
            break

    def refit(model: Any, covariance: bool) -> FitResult:
        return fit(
            objective,
            model,
            solver,
            free=free,
            bounds=bounds,
            max_steps=max_steps,
            throw=False,
            progress=progress,
            covariance=covariance,
        )

    ends = []
    for cand in picked:
        again = refit(cand.model, covariance=False)
        if again.success and _distinct(_theta_e(again.model), [theta]):
            ends.append(again)
    lowest = min(ends, key=lambda e: float(e.value), default=None)
    if lowest is not None and float(lowest.value) < reference:
        # a candidate went lower than the chosen minimum: it takes its place
        say(
            f"    a rival minimum went lower (theta_E {_theta_e(lowest.model):.4f}, "
            f"objective {float(lowest.value) - reference:+.2f}): it is chosen"
        )
        old = chosen
        chosen = refit(lowest.model, covariance=True)
        ends = [e for e in ends if e is not lowest] + [old]
        theta, reference = _theta_e(chosen.model), float(chosen.value)
    rivals = tuple(
        e
        for e in ends
        if float(e.value) - reference <= RIVAL_TOLERANCE and _distinct(_theta_e(e.model), [theta])
    )
    if not rivals:
        return chosen, ()
    notes = tuple(
        f"{RIVAL_NOTE}: theta_E {_theta_e(e.model):.4f} against "
        f"{theta:.4f} (objective {float(e.value) - reference:+.2f}, within "
        f"{RIVAL_TOLERANCE:g}): the data do not decide between them"
        for e in rivals
    )
    for note in notes:
        say(f"    {note}")
    code = RESULTS.ambiguous if chosen.success else chosen.result
    return dataclasses.replace(chosen, result=code, notes=(*chosen.notes, *notes)), rivals


def with_earlier_rivals(result: FitResult, earlier: FitResult, stage: str) -> FitResult:
    """`result`, a later fit started from `earlier`'s minimum (e.g. the pixelized chain
    from `fit_lens`), with the rival minima `earlier` found (`with_rival_minima`) named in
    its notes, prefixed by `stage` (the earlier fit's name): the later fit explored the
    chosen minimum only, so the choice between them is still not made by the data, and a
    successful status becomes `RESULTS.ambiguous`. `result` unchanged when `earlier` had
    no rivals."""
    notes = tuple(
        f"{stage}: {n} (the later stages started from its chosen minimum only)"
        for n in earlier.notes
        if n.startswith(RIVAL_NOTE)
    )
    if not notes:
        return result
    code = RESULTS.ambiguous if result.success else result.result
    return dataclasses.replace(result, result=code, notes=(*result.notes, *notes))
