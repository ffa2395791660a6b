"""Point estimates of the random weights: MAP and maximum likelihood, on minibatches.

Fitting is Pyro's own: ``SVI`` with an :class:`~pyro.infer.autoguide.AutoDelta`
guide started at the module's weights (:func:`~pyro_bdl.lift.init_to_module`). With
``mle=True`` the priors of the latent sites are masked out, which with a decoupled
weight decay (``pyro.optim.AdamW``) is ordinary regularised fine-tuning.
"""

from __future__ import annotations

from collections.abc import Callable

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from pyro.poutine.messenger import Messenger
from tqdm.auto import trange

from pyro_bdl import distributed
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.lift import init_to_module

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

    Example::

        theta_map = fit_map(model, train_loader, len(train_set), num_steps=2000,
                            optimizer=pyro.optim.Adam({"lr": 1e-3}))

    .. note:: LoRA adapters start with ``B = 0`` (peft's default), so ``A`` gets no
        likelihood gradient at first, only the prior's; Adam's normalised steps then shrink
        ``A`` to zero and the adapters never fine-tune. Fine-tune LoRA with
        :func:`~pyro_bdl.inference.baselines.map_estimate` (AdamW whose small decoupled
        decay stands for the prior, as in Laplace-LoRA and BLoB) and hand its values on,
        e.g. to :meth:`~pyro_bdl.inference.LaplaceGuide.fit` as ``map=``.

    :param callable model: a Pyro model.
    :param args: the model's arguments (DataLoaders stand for minibatches).
    :param int num_steps: optimisation steps.
    :param optimizer: a ``pyro.optim`` optimiser (default Adam, lr 1e-3).
    :param bool mle: ignore the priors (maximum likelihood).
    :param callable init_loc_fn: where the latent sites start.
    :param bool progress: show a progress bar.
    :return: the fitted value of every latent site.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
    batches = Minibatches(args, kwargs)
    fitted_model = MaskPriors()(model) if mle else model
    _drop_params()
    guide = _FitMapDelta(fitted_model, init_loc_fn=init_loc_fn)
    # Set the guide up without autograd: its prototype trace would otherwise keep the
    # graph, and so the activations, of a whole forward pass for the entire fit.
    first_args, first_kwargs = batches.peek()
    with torch.no_grad():
        guide(*first_args, **first_kwargs)
    # data-parallel (torchrun): rank 0's start, gradients averaged at every step
    distributed.broadcast_([value for _, value in sorted(guide.named_parameters())])
    optimizer = distributed.DataParallelOptim(optimizer or pyro.optim.Adam({"lr": 1e-3}))
    svi = SVI(fitted_model, guide, optimizer, Trace_ELBO())
    bar = trange(num_steps, desc="MLE" if mle else "MAP", disable=not progress, leave=False)
    for _ in bar:
        step_args, step_kwargs = batches.next()
        loss = svi.step(*step_args, **step_kwargs)
        bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
    with torch.no_grad():
        fitted = {name: value.detach().clone() for name, value in guide.median().items()}
    # The guide's locations are returned; keeping them would make the next fit start
    # from this one's result. Point weights (the model's own params) stay.
    _drop_params()
    return fitted


class _FitMapDelta(AutoDelta):
    """An AutoDelta whose params (named ``_FitMapDelta.*``) belong to fit_map alone."""


def _drop_params() -> None:
    store = pyro.get_param_store()
    for name in [name for name in store.keys() if name.startswith("_FitMapDelta.")]:
        del store[name]
