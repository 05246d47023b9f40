"""Point-spread functions and convolution operators."""

from ._psf import (
    AbstractPSF as AbstractPSF,
    FFTConvolution as FFTConvolution,
    GaussianPSF as GaussianPSF,
    PixelPSF as PixelPSF,
    direct_convolve as direct_convolve,
    fast_fft_size as fast_fft_size,
    fft_padded_shape as fft_padded_shape,
)
