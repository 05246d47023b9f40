"""The Bayesian evidence of a pixelized-source lens model (a linear inversion per call)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Scalar

from .._autodiff import reverse_mode_scalar
from .._lens_system import LensSystem
from ..data import Imaging
from ..inversion import (
    AbstractRoute,
    AutoRoute,
    DenseRoute,
    Inversion,
    LinearProblem,
    RouteData,
    choose,
    log_evidence,
    map_to_image,
    map_to_source,
    mapped_pixels,
    noise_normalisation,
    prepared,
    route_class,
    route_names,
    solves_on_host,
    source_signal,
)
from ..source._geometry import SparseSymmetric
from ..source._pixelized import PixelizedSource, regularization_matrix
from ._imaging import AbstractImagingTerm, _used_pixels


class LogEvidence(AbstractImagingTerm):
    """Minus the log Bayesian evidence of an `Imaging` dataset for a `LensSystem` whose
    source is a `PixelizedSource` (Suyu et al. 2006; Dye & Warren 2005):

        -log E = 0.5 [chi2 + s^T H s + log det(F + H) - log det H + sum log(2 pi sigma^2)],

    where the source values `s` (and the amplitudes of any linear lens-light components,
    solved in the same system, unregularized) maximise the posterior: `(F + H) s = D` with
    `D = (BM)^T W d`, `F = (BM)^T W (BM)`, `M` the mapping of the mesh's interpolation over
    the image (sub-)pixels, `B` the PSF, `W = 1/sigma^2` on the mask and `H` the
    regularization (`PixelizedSource.regularization`). The source is mapped to the mask
    grown by the PSF half-width (light just outside the mask is blurred into it).

    A fit minimising this term varies the mass model and the regularization strength (the
    evidence sets it); `complete` fills in the solved source and amplitudes; `invert`
    returns everything (`equilens.inversion.Inversion`). A singular system gives `+inf`,
    never NaN.

    **Arguments:** `imaging` (PSF at the data resolution); `route` ("auto", "sparse",
    "dense", "w_tilde" or the name of a route registered with
    `equilens.inversion.register_route`: how the linear system is built and solved, see
    `equilens.inversion`; "auto" (`equilens.inversion.AutoRoute`) takes "sparse", the tiled
    Numba kernels, on a CPU and "dense" on an accelerator; all give the same evidence to
    round-off; the prepared route is the field `solver`); `nonnegative` (default False:
    constrain the source values to be `>= 0`); `adapt_image` (a brightness estimate of the
    lensed source, `(ny, nx)`, for `AdaptiveBrightness`; default the data);
    `map_outside_mask` (default True: the source is mapped to the mask grown by the PSF
    half-width; False maps it to the mask's pixels alone, so no light from outside the mask
    is blurred into it, as PyAutoLens does: see docs/pixelized.md, "equilens and
    PyAutoLens"); `marginalise_amplitudes` (default True: the linear lens-light amplitudes
    are integrated out with a flat prior, so `log det(F + H)` is that of the whole system;
    False holds them at their solved values and integrates out the source alone: the log det
    of the source block of `F + H`, as PyAutoLens; the evidence then does not depend on the
    amplitudes' units, and costs a second factorisation when there is lens light).
    """

    imaging: Imaging
    linear: bool = eqx.field(static=True)
    nonnegative: bool = eqx.field(static=True)
    map_outside_mask: bool = eqx.field(static=True)
    marginalise_amplitudes: bool = eqx.field(static=True)
    pixels: Int[Array, " n"]
    mapped: Int[Array, " p"]
    sub_x: Float[Array, "p s2"]
    sub_y: Float[Array, "p s2"]
    adapt: Float[Array, " p"]
    solver: AbstractRoute | AutoRoute
    route: str = eqx.field(static=True)

    def __init__(
        self,
        imaging: Imaging,
        *,
        route: str = "auto",
        nonnegative: bool = False,
        adapt_image: Float[Array, "ny nx"] | np.ndarray | None = None,
        map_outside_mask: bool = True,
        marginalise_amplitudes: bool = True,
    ):
        if not isinstance(imaging, Imaging):
            raise TypeError(f"LogEvidence needs an Imaging dataset, got {type(imaging)}")
        if route not in route_names():
            raise ValueError(f"route must be one of {route_names()}, got {route!r}")
        if imaging.psf.supersampling != 1:
            raise ValueError(
                "LogEvidence needs a PSF at the data resolution (psf.supersampling == 1); "
                "supersample the model with Imaging(supersampling=...) instead"
            )
        self.imaging = imaging
        self.linear = True
        self.nonnegative = bool(nonnegative)
        self.route = route
        self.pixels = _used_pixels(imaging)
        kernel = np.asarray(imaging.psf.kernel(), dtype=np.float64)
        mask = np.asarray(imaging.mask)
        self.map_outside_mask = bool(map_outside_mask)
        self.marginalise_amplitudes = bool(marginalise_amplitudes)
        mapped = mapped_pixels(mask, kernel.shape if self.map_outside_mask else (1, 1))
        self.mapped = jnp.asarray(mapped)
        grid = imaging.grid
        s = grid.supersampling
        ny, nx = grid.shape
        xs, ys = (
            np.asarray(c).reshape(ny, s, nx, s).transpose(0, 2, 1, 3).reshape(ny * nx, s * s)
            for c in grid.coordinates(supersampled=True)
        )
        self.sub_x = jnp.asarray(xs[mapped])
        self.sub_y = jnp.asarray(ys[mapped])
        adapt = np.asarray(imaging.data) if adapt_image is None else np.asarray(adapt_image)
        if adapt.shape != grid.shape:
            raise ValueError(f"adapt_image shape {adapt.shape} does not match {grid.shape}")
        self.adapt = jnp.asarray(np.maximum(adapt.reshape(-1)[mapped], 0.0), imaging.data.dtype)
        noise = np.asarray(imaging.noise_map)
        data = RouteData(
            kernel=kernel,
            weight=np.where(mask, 1.0 / noise**2, 0.0),
            pixels=np.asarray(self.pixels),
            mapped=mapped,
            dtype=np.dtype(imaging.data.dtype),
            platform=jax.default_backend(),
        )
        solver = AutoRoute if route == "auto" else route_class(route)
        self.solver = solver.prepare(data)

    def route_for(self, n_source: int, n_weights: int) -> str:
        """The route used for `n_source` source pixels with `n_weights` interpolation
        weights per image pixel ("dense", "w_tilde", "sparse" or a registered route)."""
        return choose(self.solver, n_source, n_weights, int(self.pixels.shape[0])).name

    def routes(self) -> tuple[AbstractRoute, ...]:
        """The routes prepared for this term's dataset (those `invert` may take)."""
        return prepared(self.solver)

    def _route(self, name: str) -> AbstractRoute:
        for r in prepared(self.solver):
            if r.name == name:
                return r
        if route_class(name) is DenseRoute:  # (no tables: always at hand)
            return DenseRoute()
        raise ValueError(f"route {name!r} needs LogEvidence(..., route={name!r})")

    def invert(
        self, system: LensSystem, errors: bool = False, route: str | None = None
    ) -> Inversion:
        """Solves for the source (and linear lens light) of `system`; with `errors`, also
        the 1-sigma errors of the source values (one more `n^3` solve). `route` overrides
        the term's route ("dense" always works; "w_tilde" and "sparse" need their tables,
        built by `LogEvidence(..., route=...)` or "auto")."""
        src = system.source
        if not isinstance(src, PixelizedSource):
            raise TypeError(
                f"LogEvidence needs a LensSystem whose source is a PixelizedSource, got "
                f"{type(src).__name__}"
            )
        imaging = self.imaging
        grid = imaging.grid
        ny, nx = grid.shape
        n_s = src.n_pixels
        n_r = int(self.pixels.shape[0])
        if n_s > n_r:
            raise ValueError(
                f"the source mesh has {n_s} pixels but the mask only {n_r}: use a coarser "
                "mesh or a larger mask"
            )
        n_p, s2 = self.sub_x.shape
        # (the mapping's image-pixel rows split over the devices of a sharded grid; the
        # source-plane solve below is replicated)
        bx, by = system.mass.ray_shoot(grid.split_rows(self.sub_x), grid.split_rows(self.sub_y))
        if src.mesh.uses_signal:
            # (a brightness-adaptive mesh places its nodes by the adapt image, per sub-pixel)
            signal = jnp.repeat(self.adapt, s2)
            geometry = src.mesh.geometry(system.mass, bx.reshape(-1), by.reshape(-1), signal)
        else:
            geometry = src.mesh.geometry(system.mass, bx.reshape(-1), by.reshape(-1))
        idx, w = geometry.interpolation(bx.reshape(-1), by.reshape(-1))
        k = s2 * idx.shape[1]
        idx = idx.reshape(n_p, k)
        w = w.reshape(n_p, k) * (grid.pixel_area / s2)

        conv = imaging.convolution
        images, fixed = system.linear_images(grid, conv, fields=("lens_light",))
        n_lin = images.shape[0]
        data = imaging.data if fixed is None else imaging.data - fixed
        noise = imaging.noise_map.reshape(-1)[self.pixels]
        inv_sigma = 1.0 / noise
        target = data.reshape(-1)[self.pixels] * inv_sigma
        light = images.reshape(n_lin, ny * nx)[:, self.pixels] * inv_sigma[None, :]

        if src.regularization.uses_signal:
            total = map_to_source(idx, w, self.adapt, n_s)
            cover = map_to_source(idx, w, jnp.ones_like(self.adapt), n_s)
            signal = source_signal(jnp, total, cover)
        else:
            signal = jnp.zeros(n_s, w.dtype)
        # (a SparseSymmetric H stays by entries: made dense only on the routes that add
        # it in JAX)
        reg, log_det_reg = regularization_matrix(src.regularization, geometry, signal)

        chosen = choose(self.solver, n_s, k, n_r) if route is None else self._route(route)
        if src.regularization.factored_logdet and isinstance(reg, SparseSymmetric):
            # the route's own factorisation of H's entries where it has one (the dense one
            # above is then unused, and left out of the compiled program)
            own = chosen.entries_logdet(reg)
            log_det_reg = log_det_reg if own is None else own
        problem = LinearProblem(
            idx=idx,
            w=w,
            target=target,
            light=light,
            inv_sigma=inv_sigma,
            regularization=reg,
            positive=jnp.arange(n_lin + n_s) >= n_lin if self.nonnegative else None,
            pixels=self.pixels,
            mapped=self.mapped,
            convolution=conv,
            n_source=n_s,
            fixed_sparsity=src.regularization.fixed_sparsity,
            # the amplitudes held at their solved values: log det of the source block
            # alone (a second factorisation, on the route's own solver)
            profiled=not self.marginalise_amplitudes and n_lin > 0,
        )
        solved = chosen.solve(problem, errors)
        sol = solved.solution
        log_det_curvature = (
            sol.log_det_curvature if solved.block_log_det is None else solved.block_log_det
        )
        # A singular system (or regularization) has a -inf evidence: the terms below are
        # then computed from zeros in place of its NaN solution (and reported as NaN), so
        # that its gradient is zero rather than NaN (a NaN would poison an optimiser's
        # state).
        ok = (
            jnp.all(jnp.isfinite(sol.x))
            & jnp.isfinite(log_det_curvature)
            & jnp.isfinite(log_det_reg)
        )
        x = jnp.where(ok, sol.x, 0.0)
        amps, values = x[:n_lin], x[n_lin:]

        flux = map_to_image(idx, w, values)
        lensed = jnp.zeros(ny * nx, w.dtype).at[self.mapped].set(flux).reshape(ny, nx)
        source_image = conv(grid.gathered(lensed))
        model = source_image + jnp.tensordot(amps, images, axes=1)
        if fixed is not None:
            model = model + fixed
        resid = ((imaging.data - model) / imaging.noise_map).reshape(-1)[self.pixels]
        residuals = jnp.zeros(ny * nx, w.dtype).at[self.pixels].set(resid).reshape(ny, nx)
        chi2 = jnp.sum(resid * resid)
        reg_term = (
            reg.quadratic(values) if isinstance(reg, SparseSymmetric) else values @ (reg @ values)
        )
        norm = noise_normalisation(jnp, noise)
        fit = chi2 + reg_term if solved.fit is None else jnp.where(ok, solved.fit, 0.0)
        log_ev = log_evidence(
            fit, jnp.where(ok, log_det_curvature, 0.0), jnp.where(ok, log_det_reg, 0.0), norm
        )
        valid = ok & jnp.isfinite(log_ev)
        log_ev = jnp.where(valid, log_ev, -jnp.inf)
        err = jnp.zeros_like(values)
        if errors:
            err = jnp.sqrt(jnp.maximum(sol.inverse_diagonal()[n_lin:], 0.0))

        def reported(v):
            return jnp.where(ok, v, jnp.nan)

        return Inversion(
            values=reported(values),
            errors=reported(err),
            amplitudes=reported(amps),
            geometry=geometry,
            model_image=reported(model),
            residuals=reported(residuals),
            chi2=reported(chi2),
            regularization_term=reported(reg_term),
            log_det_curvature=log_det_curvature,
            log_det_regularization=log_det_reg,
            noise_normalisation=norm,
            log_evidence=log_ev,
            valid=valid,
            route=chosen.name,
        )

    def __call__(self, model: LensSystem) -> Scalar:
        if solves_on_host(self.solver):
            # A host route's kernels have a reverse-mode rule only: forward mode
            # (`jax.linearize`, what the optimistix minimisers use) is built on it, and
            # Hessians go through the dense route (the same function in pure JAX).
            return reverse_mode_scalar(_minus_log_evidence, _minus_log_evidence_dense, self, model)
        return _minus_log_evidence(self, model)

    def log_evidence(self, system: LensSystem) -> Scalar:
        """The log evidence (`-term(system)`); `-inf` for a singular system."""
        return self.invert(system).log_evidence

    def model_image(self, system: LensSystem) -> Float[Array, "ny nx"]:
        return self.invert(system).model_image

    @property
    def adapt_image(self) -> Float[Array, "ny nx"]:
        """The brightness estimate `AdaptiveBrightness` adapts to, as an `(ny, nx)` image
        (zero off the pixels the source is mapped to, its negative values clipped):
        `LogEvidence(imaging, adapt_image=term.adapt_image)` is the same term."""
        ny, nx = self.imaging.grid.shape
        flat = jnp.zeros(ny * nx, self.adapt.dtype).at[self.mapped].set(self.adapt)
        return flat.reshape(ny, nx)

    def complete(self, system: LensSystem) -> LensSystem:
        """`system` with the solved source values (and mesh) and linear amplitudes."""
        return with_inversion(system, self.invert(system))

    def chi2(self, system: LensSystem) -> Scalar:
        return self.invert(system).chi2


def _minus_log_evidence(term: LogEvidence, model: LensSystem) -> Scalar:
    return -term.invert(model).log_evidence


def _minus_log_evidence_dense(term: LogEvidence, model: LensSystem) -> Scalar:
    return -term.invert(model, route="dense").log_evidence


def with_inversion(system: LensSystem, inv: Inversion) -> LensSystem:
    """`system` with the source values, mesh and linear amplitudes of `inv` filled in."""
    out = eqx.tree_at(
        lambda s: (s.source.values, s.source.geometry), system, (inv.values, inv.geometry)
    )
    if inv.amplitudes.shape[0]:
        out = out.with_amplitudes(inv.amplitudes)
    return out
