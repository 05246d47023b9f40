"""Times PyAutoLens's pixelized log-evidence on the arrays written by bench_pixelized.py.

Run by bench_pixelized.py in a separate Python 3.12 environment with `autolens` and
`numba` installed (PyAutoLens's current releases need Python >= 3.12):

    python autolens_evidence.py INPUT.npz

Prints one JSON line: the median time of `FitImaging(...).log_evidence` for each path, its
first-call time, and the log-evidence value, with PyAutoLens's default settings (a
positive-only solve with the mesh's edge pixels fixed at zero, border relocation) and with
the settings that solve the problem equilens solves ("/matched": the positive-negative
solve, no relocation; docs/pixelized.md, "equilens and PyAutoLens"). PyAutoLens is used only
here, never by equilens.
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

    # (PyAutoLens's first row is the top of the image, equilens's the bottom)
    def flipped(a):
        return al.Array2D.no_mask(np.array(a[::-1], np.float64), pixel_scales=ps)

    data, noise = flipped(arrays["data"]), flipped(arrays["noise_map"])
    psf = al.Convolver(kernel=flipped(arrays["psf"]), normalize=True)
    mask = al.Mask2D(mask=~arrays["mask"][::-1], pixel_scales=ps)
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
    configurations = {
        "": None,
        "/matched": al.Settings(use_positive_only_solver=False, use_border_relocator=False),
    }
    for name, dataset in datasets.items():
        for suffix, settings in configurations.items():

            def evidence(dataset=dataset, settings=settings):
                return float(
                    al.FitImaging(dataset=dataset, tracer=tracer, settings=settings).log_evidence
                )

            t0 = time.perf_counter()
            value = evidence()
            first = time.perf_counter() - t0
            for _ in range(int(arrays["warmup"]) if "warmup" in arrays else 0):  # as equilens
                evidence()
            times = []
            for _ in range(int(arrays["repeats"])):
                t0 = time.perf_counter()
                evidence()
                times.append(time.perf_counter() - t0)
            out[name + suffix] = {
                "median_s": statistics.median(times),
                "first_s": first,
                "log_evidence": value,
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
