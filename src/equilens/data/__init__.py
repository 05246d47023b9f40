"""Datasets: imaging from arrays or FITS files, and simulation."""

from ._imaging import DataWarning as DataWarning, Imaging as Imaging
from ._multiband import MultiBandImaging as MultiBandImaging
from ._simulate import simulate as simulate, simulate_batch as simulate_batch
