"""Point estimates of the random weights: MAP and maximum likelihood, on minibatches.

Fitting is Pyro's own: ``SVI`` with an :class:`~pyro.infer.autoguide.AutoDelta`
guide started at the module's weights (:func:`~pyro_bdl.lift.init_to_module`). With
``mle=True`` the priors of the latent sites are masked out, which with a decoupled
weight decay (``pyro.optim.AdamW``) is ordinary regularised fine-tuning.

Every point fit of the library goes through :func:`minimise`: :func:`fit_map` (which adds
the check that the loss stopped falling), the baselines' fine-tunes
(:func:`~pyro_bdl.inference.baselines.map_estimate` and the others call :func:`fit_map`)
and the MAP stage of :meth:`LaplaceGuide.fit <pyro_bdl.inference.LaplaceGuide.fit>`
(in the unconstrained space, followed by the guide's own refinement and mode check).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from operator import attrgetter

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoGuide
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors
from pyro.nn import PyroModule, PyroParam
from pyro.ops.tensor_utils import periodic_repeat
from pyro.poutine.messenger import Messenger
from tqdm.auto import trange

from pyro_bdl import distributed
from pyro_bdl._checks import function, instance, integer
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sites import LatentSites
from pyro_bdl.lift import init_to_module
from pyro_bdl.model_checks import CheckedPrototype

__all__ = ["fit_map", "MaskPriors"]


class MaskPriors(Messenger):
    """Drop the log density of every latent site (keep only the likelihood)."""

    def _pyro_sample(self, msg: dict) -> None:
        if not msg["is_observed"]:
            msg["mask"] = False


def fit_map(
    model: Callable,
    *args,
    num_steps: int,
    optimizer: pyro.optim.PyroOptim | None = None,
    mle: bool = False,
    init_loc_fn: Callable = init_to_module,
    progress: bool = True,
    **kwargs,
) -> dict[str, torch.Tensor]:
    """Maximise the minibatch log joint (or the likelihood) over the latent sites.

    DataLoader arguments are replaced by a fresh minibatch at every step, as in the
    SGMCMC kernels. Point weights (``pyro.param`` sites) are trained alongside.

    A fit whose loss is still falling at the end warns: the mean loss of the last fifth
    of the steps is compared with that of the fifth before it, and a drop of more than
    three standard errors and more than half a nat (the log joint half a nat below its
    maximum is one posterior standard deviation from the mode, for a Gaussian posterior)
    means the returned values are not the optimum.

    Example::

        theta_map = fit_map(model, train_loader, len(train_set), num_steps=2000,
                            optimizer=pyro.optim.Adam({"lr": 1e-3}))

    .. note:: LoRA adapters start with ``B = 0`` (peft's default), so ``A`` gets no
        likelihood gradient at first, only the prior's; Adam's normalised steps then shrink
        ``A`` to zero and the adapters never fine-tune. Fine-tune LoRA with
        :func:`~pyro_bdl.inference.baselines.map_estimate` (AdamW whose small decoupled
        decay stands for the prior, as in Laplace-LoRA and BLoB) and hand its
        :meth:`~pyro_bdl.inference.baselines.Predictor.point` on, e.g. to
        :meth:`~pyro_bdl.inference.LaplaceGuide.fit` as ``map=``.

    :param callable model: a Pyro model.
    :param args: the model's arguments (DataLoaders stand for minibatches).
    :param int num_steps: optimisation steps.
    :param optimizer: a ``pyro.optim`` optimiser (default Adam, lr 1e-3).
    :param bool mle: ignore the priors (maximum likelihood).
    :param callable init_loc_fn: where the latent sites start.
    :param bool progress: show a progress bar.
    :return: the fitted value of every latent site.
    """
    fitted, losses = minimise(model, args, kwargs, num_steps, optimizer, mle, init_loc_fn, progress)
    falling = still_falling(losses)
    if falling is not None:
        drop, error = falling
        warnings.warn(
            f"fit_map: the loss was still falling at the end ({drop:.4g} +- {error:.2g} "
            f"nats lower over the last {len(losses) // 5} of num_steps={num_steps} steps); "
            f"the values returned are not the {'maximum likelihood' if mle else 'MAP'}. "
            f"Raise num_steps, or the learning rate ({_learning_rate(optimizer)})",
            stacklevel=2,
        )
    return fitted


def minimise(
    model: Callable,
    args: tuple,
    kwargs: dict,
    num_steps: int,
    optimizer: pyro.optim.PyroOptim | None,
    mle: bool,
    init_loc_fn: Callable,
    progress: bool,
    jacobian: bool = False,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The optimisation of :func:`fit_map`, returning the values and every step's loss.

    With ``jacobian`` the point is the mode of the log joint in the unconstrained space,
    :math:`\\log p(\\mathcal{D}, T(z)) + \\log|\\partial x / \\partial z|`, which Pyro's
    ``AutoLaplaceApproximation`` fits (the same as the MAP for real sites).
    """
    function("model", model, "a Pyro model (a callable)")
    num_steps = integer("num_steps", num_steps, low=0)
    if optimizer is not None:
        instance("optimizer", optimizer, pyro.optim.PyroOptim, "a pyro.optim optimiser or None")
    instance("mle", mle, bool, "True or False")
    function("init_loc_fn", init_loc_fn, "a Pyro init strategy (site -> value)")
    batches = Minibatches(args, kwargs)
    fitted_model = MaskPriors()(model) if mle else model
    _drop_params()
    guide = _FitMapDelta(fitted_model, init_loc_fn=init_loc_fn, jacobian=jacobian)
    # Set the guide up without autograd: its prototype trace would otherwise keep the
    # graph, and so the activations, of a whole forward pass for the entire fit.
    first_args, first_kwargs = batches.peek()
    with torch.no_grad(), _non_finite(0, optimizer):
        guide(*first_args, **first_kwargs)
    # data-parallel (torchrun): rank 0's start, gradients averaged at every step
    distributed.broadcast_([value for _, value in sorted(guide.named_parameters())])
    averaged = distributed.DataParallelOptim(optimizer or pyro.optim.Adam({"lr": 1e-3}))
    # A model whose latent has batch dimensions outside any plate (Pyro's eight schools
    # example) is a log joint all the same; Trace_ELBO's shape check, made when it guesses
    # the plate nesting, would refuse it.
    nesting = guide.max_plate_nesting if jacobian else math.inf
    svi = SVI(fitted_model, guide, averaged, Trace_ELBO(max_plate_nesting=nesting))
    bar = trange(num_steps, desc="MLE" if mle else "MAP", disable=not progress, leave=False)
    losses = []
    for _ in bar:
        step_args, step_kwargs = batches.next()
        with _non_finite(len(losses), optimizer):
            loss = svi.step(*step_args, **step_kwargs)
            if not math.isfinite(loss):
                raise ValueError("invalid values: the loss")
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
    with torch.no_grad():
        fitted = {name: value.detach().clone() for name, value in guide.median().items()}
    # The guide's locations are returned; keeping them would make the next fit start
    # from this one's result. Point weights (the model's own params) stay.
    _drop_params()
    return fitted, losses


def still_falling(losses: list[float]) -> tuple[float, float] | None:
    """(drop, standard error) if the last fifth of ``losses`` is clearly below the one before.

    Clearly: by more than three standard errors of the difference of the two means and
    by more than half a nat (see :func:`fit_map`). None otherwise, or if there are fewer
    than 10 losses.
    """
    window = len(losses) // 5
    if window < 5:
        return None
    before = torch.tensor(losses[-2 * window : -window], dtype=torch.float64)
    last = torch.tensor(losses[-window:], dtype=torch.float64)
    drop = float(before.mean() - last.mean())
    error = float((before.var() / window + last.var() / window).sqrt())
    return (drop, error) if drop > 3 * error and drop > 0.5 else None


def adam_at_prior_scale(
    prior_scales: Mapping[str, float], fraction: float = 0.01, point_lr: float = 1e-3
) -> pyro.optim.Adam:
    """Adam whose learning rate for each latent site is ``fraction`` of its prior's scale.

    Adam moves every coordinate by about its learning rate per step, whatever the
    gradient's size, and the prior's standard deviation is the scale the weights live
    on: at 1% of it, a weight crosses its prior's width in a hundred steps. Point
    weights (no prior) get ``point_lr``.

    :param dict prior_scales: latent site -> prior standard deviation.
    """
    rates = {
        f"{_FitMapDelta.__name__}.locs.{site}": fraction * s for site, s in prior_scales.items()
    }
    return pyro.optim.Adam(lambda name, param: {"lr": rates.get(name, point_lr)})


@contextlib.contextmanager
def _non_finite(step: int, optimizer: pyro.optim.PyroOptim | None):
    """Name the cause when a NaN or inf reaches the loss or a distribution's parameter."""
    try:
        yield
    except ValueError as error:
        if "invalid values" not in str(error):  # Pyro's check of a distribution's parameter
            raise
        _drop_params()
        raise ValueError(
            f"fit_map: the loss is not finite at step {step}; the data, the prior or the "
            f"learning rate ({_learning_rate(optimizer)}) is unusable: check the data for NaN "
            f"or inf, then lower the learning rate. ({str(error).splitlines()[0]})"
        ) from None


def _learning_rate(optimizer: pyro.optim.PyroOptim | None) -> str:
    if optimizer is None:
        return "the default Adam's lr 1e-3; pass optimizer=pyro.optim.Adam({'lr': ...})"
    settings = getattr(optimizer, "pt_optim_args", None)
    if isinstance(settings, dict) and "lr" in settings:
        return f"lr {settings['lr']} of optimizer={type(optimizer).__name__}"
    return f"of optimizer={type(optimizer).__name__}"


class _FitMapDelta(CheckedPrototype, AutoDelta):
    """An AutoDelta whose params (``_FitMapDelta.locs.*``) belong to fit_map alone.

    The locations sit in a child module ``.locs``, as AutoNormal keeps its own: Pyro's
    AutoDelta sets each site's location at the attribute path of the site's name on the
    guide itself, so a site named after one of the guide's attributes (the ``model.*``
    weights of every Hugging Face causal LM: ``AutoGuide.model``) would land on that
    attribute, outside the guide's parameters, and never be trained.

    With ``jacobian`` its params are the unconstrained values :math:`z` of the sites
    (``biject_to``, see :mod:`pyro_bdl.inference.sites`) and each site's ``Delta`` carries
    :math:`\\log|\\partial z / \\partial x|`, so that the ELBO is the log joint with the
    Jacobian, as with ``AutoLaplaceApproximation``'s ``Delta``.
    """

    def __init__(self, model, init_loc_fn, jacobian: bool = False):
        self.jacobian = jacobian
        self._checks_model = not jacobian  # LaplaceGuide's set-up checked the model
        self._checked_by = "fit_map"
        super().__init__(model, init_loc_fn=init_loc_fn)

    def _setup_prototype(self, *args, **kwargs) -> None:
        with self._checked_run(args, kwargs):  # not AutoDelta's: the locations go in .locs
            AutoGuide._setup_prototype(self, *args, **kwargs)
        self.locs = PyroModule()
        if self.jacobian:
            self.sites = LatentSites(self.prototype_trace, "LaplaceGuide")
            values = {name: site.message["value"].detach() for name, site in self.sites.items()}
            for name, z in self.sites.unconstrain(values).items():
                z = PyroParam(z.detach().clone(), constraints.real, self.sites[name].event_dim)
                deep_setattr(self.locs, name, z)
            return
        for name, site in self.prototype_trace.iter_stochastic_nodes():  # AutoDelta's start
            value = site["value"].detach()
            event_dim = site["fn"].event_dim
            for frame in site["cond_indep_stack"]:  # subsampled: the full size's values
                full_size = frame.full_size or frame.size
                if full_size != frame.size:
                    value = periodic_repeat(value, full_size, frame.dim - event_dim).contiguous()
            with helpful_support_errors(site):
                deep_setattr(self.locs, name, PyroParam(value, site["fn"].support, event_dim))

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, frames, delta in self._deltas():
            with ExitStack() as stack:
                for frame in frames:
                    stack.enter_context(plates[frame.name])
                result[name] = pyro.sample(name, delta)
        return result

    def _deltas(self) -> Iterator[tuple[str, list, dist.Delta]]:
        """Every latent site's name, vectorised plates and ``Delta`` at its location."""
        if self.jacobian:
            for name, site in self.sites.items():
                yield name, site.frames, site.delta(attrgetter(name)(self.locs))
            return
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            frames = [frame for frame in site["cond_indep_stack"] if frame.vectorized]
            location = attrgetter(name)(self.locs)
            yield name, frames, dist.Delta(location, event_dim=site["fn"].event_dim)

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        if not self.jacobian:
            return super().median(*args, **kwargs)
        locations = {name: attrgetter(name)(self.locs) for name in self.sites}
        values, _ = self.sites.constrain(locations)
        return values


def _drop_params() -> None:
    store = pyro.get_param_store()
    for name in [name for name in store.keys() if name.startswith("_FitMapDelta.")]:
        del store[name]
