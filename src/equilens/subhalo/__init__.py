"""Subhalo detection: `subhalo_scan` (a grid of cells over the arcs, each the smooth model
plus a `Subhalo` confined to it, compared with the smooth model by the evidence), the
`Subhalo` perturber (a TNFW or pseudo-Jaffe of a given mass in a cell), the scan's
result, `SubhaloScan`, and its figure, `plot_subhalo_scan`; `subhalo_evidence`: a cell's
evidence difference by nested sampling, with its error, and the subhalo's posterior."""

from ._figure import plot_subhalo_scan as plot_subhalo_scan
from ._grid import scan_cells as scan_cells
from ._nested import SubhaloEvidence as SubhaloEvidence, subhalo_evidence as subhalo_evidence
from ._profile import (
    MASS_RANGE as MASS_RANGE,
    PSEUDO_JAFFE_CORE as PSEUDO_JAFFE_CORE,
    Subhalo as Subhalo,
    duffy_concentration as duffy_concentration,
)
from ._scan import (
    SubhaloScan as SubhaloScan,
    scan_free as scan_free,
    subhalo_scan as subhalo_scan,
    with_subhalo as with_subhalo,
)
