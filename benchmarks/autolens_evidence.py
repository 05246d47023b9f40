"""Times PyAutoLens's pixelized log-evidence on the arrays written by bench_pixelized.py.

Run by bench_pixelized.py in a separate Python 3.12 environment with `autolens` and
`numba` installed (PyAutoLens's current releases need Python >= 3.12):

    python autolens_evidence.py INPUT.npz

Prints one JSON line: the median time of `FitImaging(...).log_evidence` for each mesh, its
first-call time, and the log-evidence value. PyAutoLens is used only here, never by equilens.
"""

import json
import statistics
import sys
import time

import numpy as np


def main(path: str) -> None:
    import autolens as al

    arrays = np.load(path)
    ps = float(arrays["pixel_scale"])
    data = al.Array2D.no_mask(arrays["data"], pixel_scales=ps)
    noise = al.Array2D.no_mask(arrays["noise_map"], pixel_scales=ps)
    psf = al.Convolver(kernel=al.Array2D.no_mask(arrays["psf"], pixel_scales=ps), normalize=True)
    mask = al.Mask2D(mask=~arrays["mask"], pixel_scales=ps)
    # no sub-gridding, as the equilens benchmark (PyAutoLens defaults to 4x4 for sources)
    plain = al.Imaging(
        data=data, noise_map=noise, psf=psf, over_sample_size_lp=1, over_sample_size_pixelization=1
    ).apply_mask(mask=mask)
    datasets = {"mapping": plain}
    try:
        t0 = time.perf_counter()
        datasets["sparse"] = plain.apply_sparse_operator_cpu()
        setup = time.perf_counter() - t0
    except Exception as err:
        setup = repr(err)
    lens = al.Galaxy(
        redshift=0.5,
        mass=al.mp.Isothermal(centre=(0.0, 0.0), einstein_radius=float(arrays["theta_E"])),
    )
    out = {"version": al.__version__, "sparse_setup_s": setup}
    mesh = al.mesh.RectangularUniform(shape=tuple(int(v) for v in arrays["rect_shape"]))
    pix = al.Pixelization(mesh=mesh, regularization=al.reg.Constant(coefficient=1.0))
    tracer = al.Tracer(galaxies=[lens, al.Galaxy(redshift=1.0, pixelization=pix)])
    for name, dataset in datasets.items():
        t0 = time.perf_counter()
        value = float(al.FitImaging(dataset=dataset, tracer=tracer).log_evidence)
        first = time.perf_counter() - t0
        for _ in range(int(arrays["warmup"]) if "warmup" in arrays else 0):  # as for equilens
            float(al.FitImaging(dataset=dataset, tracer=tracer).log_evidence)
        times = []
        for _ in range(int(arrays["repeats"])):
            t0 = time.perf_counter()
            float(al.FitImaging(dataset=dataset, tracer=tracer).log_evidence)
            times.append(time.perf_counter() - t0)
        out[name] = {"median_s": statistics.median(times), "first_s": first, "log_evidence": value}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
