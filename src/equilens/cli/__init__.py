"""The `equilens` command.

`equilens demo [--output DIR] [--solver NAME]` fits the HST image of SDSS J0946+1006 shipped
with the package (SIE + external shear, multi-Gaussian lens light, Sersic source with linear
amplitudes, 3" circular mask, 2x2 supersampling, generic start) and writes `demo.json` and
`demo.png` to DIR (default `equilens_demo`).

`equilens fit IMAGE.fits --noise-map NOISE.fits --psf PSF.fits --pixel-scale 0.05
[--exclude-mask MASK.fits] [--mask-radius R] --mass sie+shear [--lens-light mge|sersic|none]
--source sersic --json OUT.json` fits a user's data the same way (`equilens.solve.fit_lens`:
a Sersic source that leaves arcs gets a second Sersic when the Bayesian information
criterion prefers it) and writes OUT.json and a PNG next to it. With `--source pixelized
[--mesh rectangular[:NYxNX]|adaptive[:NYxNX]|delaunay[:N]]
[--regularization constant|curvature|adaptive|matern]
[--regularization-strength L]` the parametric fit is followed by a pixelized-source fit that
maximises the Bayesian evidence (strength fitted unless given; the lens light refitted
beside the source; with `--power-law`, last, an SIE's slope freed and the power law kept
when the evidence prefers it); the JSON adds `log_evidence`, the stages' records
and the source-plane reconstruction is written as OUT_source.fits (HDU 0 the source in
flux/arcsec^2, HDU 1 its 1-sigma errors). `--lens-light` defaults to `mge` (a linear
multi-Gaussian expansion); `none` is for data with the lens light removed. `--positions
FILE` (x y in arcsec per line: the multiple images of one source point) adds a positions
penalty (`--positions-sigma`, default a pixel). The pixelized chain holds the images of one
source point together in the source plane (a `PositionsThreshold`): the `--positions`, or
else the images of the parametric source's centre.

Several bands are fitted jointly with `--band IMAGE NOISE PSF` once per band (instead of
IMAGE, --noise-map and --psf; paths may name a FITS extension, `cutout.fits[VIS_FLUX]`),
`--pixel-scale` for all bands or `--band-pixel-scales 0.1,0.1,...` one per band,
`--band-names VIS,Y,...`; `--mask` and `--mask-radius` apply to every band. One mass model,
the lens light and source shared in shape with per-band amplitudes
(`equilens.solve.fit_multiband`: the first band is fitted alone first, then all jointly);
the JSON names each light component's band and lists each band's chi2, and one figure per
band is written (OUT_<band>.png). With `--source pixelized` the joint parametric fit is
followed by a pixelized source in every band, on one mesh (built on the first band) with a
regularization strength per band, fitted by the sum of the bands' evidences
(`equilens.solve.fit_multiband_pixelized`; OUT_<band>_source.fits per band).

`equilens sample IMAGE.fits --noise-map ... --psf ... --pixel-scale ... [--sampler auto]
[--chains 4] [--warmup 500] [--samples N] [--seed 0] --json OUT.json` (the data and model
options as for `fit`, `--band` included: several bands are fitted, then sampled jointly;
with `--source pixelized`, the mass's parameters are sampled with the source marginalised by
the evidence (each band's), the regularization held as fitted) fits, then samples the
posterior from the fit (`pip install equilens[sampling]`): with NUTS chains
(`equilens.sample`; `--samples` draws per chain, default 1000; `--max-tree-depth`, default
10, 6 for a pixelized source) or, with `--sampler nested`, nautilus on the Numba likelihood
in one worker process per CPU core (`equilens.nested_sample`; uniform priors on the fit +-
`--prior-width` (10) errors inside the class bounds, `--live` points (300), `--networks` per
bound (2), `--samples` effective samples (4000), progress every 10 s with an estimate of the
time left), which also gives the log-evidence. `--sampler auto` (the default) is nested
sampling when JAX runs on the CPU (and Numba and nautilus are installed), NUTS on an
accelerator; the choice is printed. Ctrl-C while sampling writes the draws so far (status
"interrupted"; nested sampling stops after its batch, NUTS after its chunk of draws, a
twentieth of them; a second Ctrl-C stops at once) and exits 130. OUT.json holds the fit and,
per parameter, the posterior `mean`, `std`, `p16`, `p50`, `p84` (NUTS: `ess`, `rhat`;
nested: the prior interval, and `log_evidence` with its error); the draws are written as
NetCDF (OUT.nc, ArviZ) and a corner plot as OUT_corner.png; exit status 2 when NUTS did not
converge (an R-hat at or above 1.01, or divergent transitions) or nested sampling stopped
short of its samples.

`--check` (fit and sample) checks every input and option, prints what would be fitted
and exits with status 0 without fitting or writing anything. Errors are one
line on stderr and exit status 1; a fit that did not converge, or converged to an
implausible model (a parameter at a bound, a source larger than the data), writes its
results, says why on stderr and exits with status 2.
"""

from ._check import MAX_COUNT as MAX_COUNT, MAX_SUPERSAMPLING as MAX_SUPERSAMPLING
from ._data import _load as _load
from ._demo import (
    DEMO_MASK_RADIUS as DEMO_MASK_RADIUS,
    DEMO_SUPERSAMPLING as DEMO_SUPERSAMPLING,
    demo_imaging as demo_imaging,
    run_demo as run_demo,
)
from ._fit import run_fit as run_fit, run_fit_multiband as run_fit_multiband
from ._main import main as main
from ._partial import Partial as Partial
from ._sample import choose_sampler as choose_sampler, run_sample as run_sample
from ._source import (
    DEFAULT_DELAUNAY_NODES as DEFAULT_DELAUNAY_NODES,
    DEFAULT_MESH as DEFAULT_MESH,
    DEFAULT_MESH_SHAPE as DEFAULT_MESH_SHAPE,
    MESHES as MESHES,
    REGULARIZATIONS as REGULARIZATIONS,
    default_mesh as default_mesh,
    make_mesh as make_mesh,
    make_regularization as make_regularization,
    write_source_fits as write_source_fits,
)
