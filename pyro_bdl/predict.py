"""Class probabilities of a classifier model under draws of its weights.

Every method returns predictions the same way, so metrics and experiments compare like
for like: a tensor of class probabilities shaped ``(draws, batch, classes)``, one
softmax per weight draw (``draws = 1`` for a point estimate). The mean over the first
dimension is the Bayesian model average; :func:`pyro_bdl.metrics.uncertainty_decomposition`
splits its entropy into aleatoric and epistemic parts.

Draws may live anywhere (on the CPU, read back from disk or ArviZ) and the model on a
GPU: :func:`condition_on_sites` puts each value where its site's distribution is.

:func:`predict_proba` is the one prediction over draws or a guide: the baselines'
:class:`~pyro_bdl.inference.baselines.Predictor`, the Trainers'
:meth:`~pyro_bdl.hf.BLoBTrainer.predict_proba` and the experiments call it. The Laplace
guide's :meth:`~pyro_bdl.inference.LaplaceGuide.predictive` is another approximation
(the network linearised at the MAP, a Gaussian over the logits), with the same ``(S, B,
C)`` output when it returns its logit draws.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pyro
import torch
from pyro.poutine.condition_messenger import ConditionMessenger
from pyro.poutine.util import site_is_subsample

from pyro_bdl._checks import function, integer
from pyro_bdl._offload import draw_at, num_draws
from pyro_bdl.likelihoods import _device, _parameter
from pyro_bdl.model_checks import check_model_guide, check_site_shapes

__all__ = ["predict_proba", "condition_on_sites", "posterior_size", "guide_draw"]


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
    ``(S, *shape)``, on any device, as tensors or NumPy arrays; or an ArviZ posterior whose
    variables are ``(chain, draw, *shape)``, such as ``bdl.to_arviz(checkpoint_dir)``) or a
    ``guide`` with ``num_samples``; with neither
    the model runs once at the values Pyro's handlers give it (e.g. inside
    ``net.fixed(...)``). The observation site is left unobserved and ignored: only the
    returned logits count.

    The first draw runs traced and checked (:mod:`pyro_bdl.model_checks`): a site whose log
    density does not fit its plates is a :class:`~pyro_bdl.model_checks.SiteShapeError`;
    with a guide, Pyro's ``check_model_guide_match`` runs too, and a latent site of the model
    that the guide does not sample (drawn from its prior at every draw) warns.

    Example::

        probs = predict_proba(model, batch, num_data, samples=mcmc.get_samples())
        mean_probs = probs.mean(0)

    :param callable model: a Pyro model returning logits shaped ``(batch, classes)``.
    :param samples: draws of the latent sites.
    :param guide: a fitted guide to draw from.
    :param int num_samples: number of guide draws.
    :return: probabilities ``(S, batch, classes)``.
    """
    function("model", model, "a callable Pyro model returning logits")
    count = posterior_size("predict_proba", samples, guide, num_samples)
    with torch.no_grad():
        if count is None:
            trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
            check_site_shapes(trace, "predict_proba")
            logits = trace.nodes["_RETURN"]["value"]
            return torch.softmax(_checked_logits(logits), dim=-1).unsqueeze(0)
        draws = []
        for i in range(count):
            first = i == 0  # the model is checked on its first draw, once per call
            if samples is not None:
                logits = _draw_logits(model, draw_at(samples, i), args, kwargs, first)
            else:
                logits = _guide_logits(model, guide, args, kwargs, first)
            draws.append(torch.softmax(_checked_logits(logits), dim=-1))
        return torch.stack(draws)


def condition_on_sites(
    model: Callable, values: Mapping[str, torch.Tensor], *, strict: bool = False
) -> Callable:
    """``pyro.poutine.condition(model, values)`` with each value moved to the device (and
    floating dtype) of its site's distribution, so CPU draws condition a CUDA model.

    :param callable model: a Pyro model.
    :param dict values: site name -> value (a tensor or array).
    :param bool strict: refuse (``KeyError``) a latent site that ``values`` has no value
        for, which Pyro would otherwise draw from its prior without a word.
    """
    return _ConditionOnSites(values, strict)(model)


def posterior_size(
    caller: str, samples: object, guide: Callable | None, num_samples: int | None
) -> int | None:
    """The number of draws a call with ``samples`` or ``guide`` makes (None: neither), checked.

    The arguments of every function that predicts under a posterior: ``samples`` (draws
    ``site -> (S, *shape)``, or an ArviZ posterior ``(chain, draw, *shape)``) or a
    ``guide`` with ``num_samples``, not both.

    :param str caller: the public function, named in the errors.
    """
    if samples is not None and guide is not None:
        raise ValueError(f"{caller}: pass samples or guide, not both")
    if guide is not None:
        function("guide", guide, "a callable Pyro guide or None")
        if num_samples is None:
            raise ValueError(f"{caller}: with a guide, pass num_samples >= 1")
    if num_samples is not None:
        num_samples = integer("num_samples", num_samples, low=1)
        if guide is None:
            raise ValueError(
                f"{caller}: num_samples={num_samples} is the number of draws from a guide; "
                "pass guide=<a fitted guide> with it (samples already hold their draws)"
            )
    if samples is not None:
        return num_draws(samples)
    return num_samples


def guide_draw(guide: Callable, *args, **kwargs) -> dict[str, torch.Tensor]:
    """One draw of a guide's latent sites, as values: ``guide(*args, **kwargs)`` traced.

    The values are detached copies of the draw, so that the model runs with them as with
    any other values (BLoB's flipout, which acts on the guide's own draw, stays off):
    each draw is one network.

    :param callable guide: a Pyro guide.
    :return: site -> value, the guide's auxiliary sites left out.
    """
    trace = pyro.poutine.trace(guide).get_trace(*args, **kwargs)
    return {
        name: site["value"].detach().clone()
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and not site["infer"].get("is_auxiliary")
    }


class _ConditionOnSites(ConditionMessenger):
    def __init__(self, data: Mapping, strict: bool = False):
        super().__init__(data)
        self.strict = strict

    def _pyro_sample(self, msg: dict) -> None:
        latent = not msg["is_observed"] and not site_is_subsample(msg)
        if self.strict and latent and msg["name"] not in self.data:
            raise KeyError(
                f"the draws have no value for the latent site {msg['name']!r}; they hold "
                f"{sorted(self.data)[:5]}{' ...' if len(self.data) > 5 else ''}. Pass draws "
                "of every latent site of the model (the model and the draws must match)"
            )
        super()._pyro_sample(msg)
        value = msg["value"]
        if msg["name"] in self.data and value is not None:
            value = torch.as_tensor(value)
            expected = msg["fn"].shape()
            if value.shape != expected:
                raise ValueError(
                    f"the value of site {msg['name']!r} has shape {tuple(value.shape)}, but the "
                    f"site has shape {tuple(expected)}: pass one draw per site, i.e. draws "
                    "shaped (S, *site shape) such as mcmc.get_samples() (not grouped by chain)"
                )
            like = _parameter(msg["fn"], floating=True)
            device = like.device if like is not None else _device(msg["fn"])
            dtype = like.dtype if like is not None and value.is_floating_point() else None
            msg["value"] = value.to(device=device, dtype=dtype)


def _checked_logits(logits: object) -> torch.Tensor:
    if not torch.is_tensor(logits) or logits.dim() < 2 or not logits.is_floating_point():
        got = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ValueError(
            f"predict_proba: the model must return logits shaped (batch, classes), got {got}"
        )
    return logits


def _draw_logits(model: Callable, values: Mapping, args: tuple, kwargs: dict, check: bool):
    conditioned = condition_on_sites(model, values)
    if not check:
        return conditioned(*args, **kwargs)
    trace = pyro.poutine.trace(conditioned).get_trace(*args, **kwargs)
    check_site_shapes(trace, "predict_proba")
    return trace.nodes["_RETURN"]["value"]


def _guide_logits(model: Callable, guide: Callable, args: tuple, kwargs: dict, check: bool):
    # What Predictive(model, guide=guide) does for one draw: run the guide, replay the
    # model on its values. One draw at a time keeps memory at one forward pass.
    guide_trace = pyro.poutine.trace(guide).get_trace(*args, **kwargs)
    replayed = pyro.poutine.replay(model, trace=guide_trace)
    if not check:
        return replayed(*args, **kwargs)
    model_trace = pyro.poutine.trace(replayed).get_trace(*args, **kwargs)
    observed = getattr(guide, "observed_sites", None)  # the sites the guide's fit observed
    check_model_guide(model_trace, guide_trace, "predict_proba", observed)
    return model_trace.nodes["_RETURN"]["value"]
