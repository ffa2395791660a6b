"""Class probabilities of a classifier model under draws of its weights.

Every method returns predictions the same way, so metrics and experiments compare like
for like: a tensor of class probabilities shaped ``(draws, batch, classes)``, one
softmax per weight draw (``draws = 1`` for a point estimate). The mean over the first
dimension is the Bayesian model average; :func:`pyro_bdl.metrics.uncertainty_decomposition`
splits its entropy into aleatoric and epistemic parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pyro
import torch

__all__ = ["predict_proba"]


def predict_proba(
    model: Callable,
    *args,
    samples: Mapping[str, torch.Tensor] | None = None,
    guide: Callable | None = None,
    num_samples: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """Softmax of the logits ``model(*args)`` returns, one per weight draw.

    Give either ``samples`` (a dict of draws, e.g. ``mcmc.get_samples()``, each
    ``(S, *shape)``) or a ``guide`` with ``num_samples``; with neither the model runs
    once at the values Pyro's handlers give it (e.g. inside ``net.fixed(...)``). The
    observation site is left unobserved and ignored: only the returned logits count.

    Example::

        probs = predict_proba(model, batch, num_data, samples=mcmc.get_samples())
        mean_probs = probs.mean(0)

    :param callable model: a Pyro model returning logits shaped ``(batch, classes)``.
    :param samples: draws of the latent sites.
    :param guide: a fitted guide to draw from.
    :param int num_samples: number of guide draws.
    :return: probabilities ``(S, batch, classes)``.
    """
    if samples is not None and guide is not None:
        raise ValueError("predict_proba: pass samples or guide, not both")
    if guide is not None and not num_samples:
        raise ValueError("predict_proba: with a guide, pass num_samples >= 1")
    with torch.no_grad():
        if samples is None and guide is None:
            logits = pyro.poutine.trace(model).get_trace(*args, **kwargs).nodes["_RETURN"]
            return torch.softmax(logits["value"], dim=-1).unsqueeze(0)
        num_draws = len(next(iter(samples.values()))) if samples is not None else num_samples
        draws = []
        for i in range(num_draws):
            if samples is not None:
                one = {name: value[i] for name, value in samples.items()}
                logits = pyro.poutine.condition(model, data=one)(*args, **kwargs)
            else:
                logits = _guide_logits(model, guide, args, kwargs)
            draws.append(torch.softmax(logits, dim=-1))
        return torch.stack(draws)


def _guide_logits(model: Callable, guide: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    # What Predictive(model, guide=guide) does for one draw: run the guide, replay the
    # model on its values. One draw at a time keeps memory at one forward pass.
    guide_trace = pyro.poutine.trace(guide).get_trace(*args, **kwargs)
    replayed = pyro.poutine.replay(model, trace=guide_trace)
    return replayed(*args, **kwargs)
