r"""The methods of the BLoB tables, as entry points that fit and return a predictor.

Each entry point fine-tunes the LoRA weights of a lifted peft model (from the module's
current, freshly initialised adapter) and returns a :class:`Predictor`:
``predictor(*model_args)`` gives class probabilities shaped ``(S, B, C)``, one softmax per
weight draw, like :func:`~pyro_bdl.predict.predict_proba`, so that every method is scored
the same way. The methods (BLoB, section 4.1 and Table 3):

- :func:`mle`: maximum likelihood (plain LoRA fine-tuning), ``S = 1``;
- :func:`map_estimate`: the same with AdamW weight decay (1e-5 in the paper), ``S = 1``;
- :func:`mc_dropout`: maximum likelihood with the LoRA dropout kept on at prediction,
  ``S = 10`` passes (Gal and Ghahramani, 2016);
- :func:`deep_ensemble`: ``K`` independently initialised LoRA adapters on the one base
  model, ``S = K`` (Lakshminarayanan et al., 2017; the paper uses 3);
- :func:`bbb`: Bayes by Backprop on the random LoRA weights, softplus standard deviation,
  no flipout, the plain ELBO (Blundell et al., 2015), ``S = num_samples``;
- :func:`temperature_scaling`: not a fit of the weights but of one scalar on top of any
  predictor (Guo et al., 2017): the baseline the Bayesian methods' calibration must beat.

BLoB and IVON, the table's other rows, train through their own modules:
:class:`~pyro_bdl.inference.BLoBGuide` with :func:`~pyro_bdl.inference.fit_blob` and
:class:`~pyro_bdl.inference.IVONGuide` with :func:`~pyro_bdl.inference.fit_ivon` (or
:class:`~pyro_bdl.hf.BLoBTrainer` and :class:`~pyro_bdl.hf.IVONTrainer`), and predict
with :func:`~pyro_bdl.predict.predict_proba` (``guide=``, or the guide's ``median()`` as
``samples`` for BLoB's "N=0" row).

Every method trains with the same recipe, BLoB's Table 3: AdamW with a linear warm-up over
``warmup_ratio`` (0.06) of the ``num_steps`` steps, then a linear decay to zero
(``schedule="linear"``; ``"constant"`` keeps the rate after the warm-up; both are
:func:`~pyro_bdl.inference.vi.blob_svi.warmup_schedule`, transformers' schedules), on the
minibatches the DataLoader arguments give. Give each method of a table the same
``num_steps``, ``lr``, schedule and batch size, as the paper does.

The paper's BBB "only Bayesianizes the A matrix, similar to BLoB": lift with
``random="lora_A", point="lora_B"`` for it; lifting every LoRA weight random gives BBB on
A and B. Each fit starts the network's point weights (B) afresh from the module, sets the prior
it needs only for its own duration, and each predictor keeps its own copy of every fitted
value, so methods fitted one after another on one network do not disturb each other.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, TraceMeanField_ELBO
from tqdm.auto import trange

from pyro_bdl import _checks, distributed
from pyro_bdl._offload import kept_draws
from pyro_bdl.inference.map import fit_map
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.vi import MeanFieldGuide
from pyro_bdl.inference.vi.blob_svi import warmup_schedule
from pyro_bdl.lift import LiftedModule
from pyro_bdl.posterior import STATE_KEY, PosteriorDraws, decode_json, encode_json
from pyro_bdl.predict import guide_draw, predict_proba
from pyro_bdl.priors import IIDNormal

__all__ = [
    "Predictor",
    "mle",
    "map_estimate",
    "mc_dropout",
    "deep_ensemble",
    "bbb",
    "adamw",
    "temperature_scaling",
    "TemperatureScaled",
]

# AdamW's epsilon of the reference implementation of the BLoB baselines.
_ADAM_EPS = 1e-6
# What a member holds, each a dict of tensors (Predictor.state_dict's parts).
_MEMBER_PARTS = ("model_params", "samples", "guide_params", "median")
_GUIDE_CLASSES = {"MeanFieldGuide": MeanFieldGuide}


@dataclass
class _Member:
    """One fitted set of weights: fixed draws of the random sites, or a guide to draw from."""

    model_params: dict[str, torch.Tensor]
    samples: dict[str, torch.Tensor] | None = None
    guide: Callable | None = None
    guide_params: dict[str, torch.Tensor] = field(default_factory=dict)
    median: dict[str, torch.Tensor] = field(default_factory=dict)


class Predictor:
    """Class probabilities ``(S, B, C)`` of a fitted method: ``predictor(*model_args)``.

    The draws of all members are stacked along ``S``: one per point estimate, one per
    dropout pass, ``num_samples`` per guide (the mean weights when ``num_samples`` is 0).
    The LoRA dropout is off while predicting, except for MC dropout.

    :param callable model: the Pyro model, returning logits ``(B, C)``.
    :param members: the fitted weights.
    :param int num_samples: draws per guide member (settable afterwards).
    :param dropout: the LoRA dropout layers.
    :param bool mc_dropout: keep them on while predicting.
    """

    def __init__(
        self,
        model: Callable,
        members: Sequence[_Member],
        *,
        num_samples: int = 1,
        dropout: Sequence[torch.nn.Module] = (),
        mc_dropout: bool = False,
    ):
        self.model = model
        self.members = list(members)
        self.num_samples = num_samples
        self.dropout = list(dropout)
        self.mc_dropout = mc_dropout

    @property
    def num_samples(self) -> int:
        """Draws per guide member; 0 means the guide's mean weights."""
        return self._num_samples

    @num_samples.setter
    def num_samples(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"num_samples must be an int >= 0, got {value!r}")
        self._num_samples = value

    def point(self) -> dict[str, torch.Tensor]:
        """The fitted value of every random site of a single point estimate (the weights
        :func:`map_estimate` and :func:`mle` found), e.g. for
        :meth:`~pyro_bdl.inference.LaplaceGuide.fit`'s ``map=``.

        Example::

            theta_map = map_estimate(model, loader, num_data, num_steps=500).point()

        :raises ValueError: for an ensemble, a guide or dropout draws (no single point).
        """
        if len(self.members) != 1 or self.members[0].samples is None or self.mc_dropout:
            raise ValueError(
                "point(): this predictor holds no single point estimate (an ensemble, a guide "
                "or MC dropout); it is defined for map_estimate and mle"
            )
        return {site: value[0] for site, value in self.members[0].samples.items()}

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """Probabilities of the model's classes for a batch, ``(S, B, C)``."""
        with _training_mode(self.dropout, self.mc_dropout):
            return torch.cat([self._member_probs(member, args, kwargs) for member in self.members])

    # -- the Posterior interface (pyro_bdl.posterior) ------------------------------------

    layout = "members"  # bdl.save writes the state dict (persistence.py)

    def predict_proba(self, *args, num_samples: int | None = None, **kwargs) -> torch.Tensor:
        """``predictor(*args)``; ``num_samples``: draws per guide member for this call."""
        if num_samples is None:
            return self(*args, **kwargs)
        kept, self.num_samples = self.num_samples, num_samples
        try:
            return self(*args, **kwargs)
        finally:
            self.num_samples = kept

    def draws(
        self, num_samples: int | None = None, *args, seed: int | None = None, **kwargs
    ) -> PosteriorDraws:
        """The members' weights one after the other as chain 0: each point member's value
        (an MC-dropout member's repeated per pass), ``num_samples`` (default
        :attr:`num_samples`) draws of each guide member, its mean when that is 0. The point
        weights (a LoRA B) are each member's own and not among the draws.

        :param args: the model's arguments, for a guide member that draws.
        :param int seed: seed of a guide member's draws (None: the process's state).
        """
        count = self.num_samples if num_samples is None else num_samples
        per_member = []
        with torch.random.fork_rng():
            if seed is not None:
                pyro.set_rng_seed(seed)
            for member in self.members:
                per_member.append(self._member_draws(member, count, args, kwargs))
        samples = {
            name: torch.cat([draws[name] for draws in per_member]).unsqueeze(0)
            for name in per_member[0]
        }
        return PosteriorDraws(samples=samples, attrs=self.hyperparameters())

    def sample(
        self, num_samples: int | None = None, *args, seed: int | None = None, **kwargs
    ) -> dict[str, torch.Tensor]:
        """The draws of :meth:`draws`, flat: site -> ``(S, *shape)``."""
        return self.draws(num_samples, *args, seed=seed, **kwargs).flat()

    def hyperparameters(self) -> dict:
        """``method``, the number of members, draws per guide member and MC dropout."""
        return {
            "method": type(self).__name__,
            "num_members": len(self.members),
            "num_samples": self.num_samples,
            "mc_dropout": self.mc_dropout,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every member's fitted values (``members.<k>.<part>/<name>``), and the structure
        as JSON (a guide member's class and settings) under ``"_bdl_state"``."""
        state, structure = {}, []
        for k, member in enumerate(self.members):
            for part in _MEMBER_PARTS:
                for name, value in (getattr(member, part) or {}).items():
                    state[f"members.{k}.{part}/{name}"] = value.detach()
            guide = member.guide
            structure.append(
                None
                if guide is None
                else {
                    "class": type(guide).__name__,
                    "settings": guide._init_settings(),
                    "observed": sorted(guide.observed_sites),
                }
            )
        header = {"hyperparameters": self.hyperparameters(), "members": structure}
        return {STATE_KEY: encode_json(header), **state}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned (guide members are built afresh on the
        model; their parameters are the saved values)."""
        header = decode_json(state_dict[STATE_KEY])
        members = []
        for k, spec in enumerate(header["members"]):
            parts = {part: {} for part in _MEMBER_PARTS}
            for key, value in state_dict.items():
                head, _, name = key.partition("/")
                prefix, _, part = head.rpartition(".")
                if prefix == f"members.{k}" and part in parts:
                    parts[part][name] = value
            guide = None
            if spec is not None:
                # The sites its fit observed stay hidden from it: built afresh, it must not
                # take an unobserved label for a latent site when it first sees the model.
                seen = poutine.block(self.model, hide=spec.get("observed", []))
                guide = _GUIDE_CLASSES[spec["class"]]._from_settings(seen, spec["settings"])
            members.append(
                _Member(
                    model_params=parts["model_params"],
                    samples=parts["samples"] or None,
                    guide=guide,
                    guide_params=parts["guide_params"],
                    median=parts["median"],
                )
            )
        self.members = members
        settings = header["hyperparameters"]
        self.num_samples, self.mc_dropout = settings["num_samples"], settings["mc_dropout"]

    @classmethod
    def from_state_dict(cls, model: Callable, state_dict: Mapping[str, torch.Tensor]) -> Predictor:
        """The predictor :meth:`state_dict` describes, on ``model`` (its LoRA dropout layers
        found on ``model.net`` as the fits find them).

        :param callable model: the Pyro model the predictor was fitted with.
        """
        net = getattr(model, "net", None)
        dropout = _lora_dropout(net) if isinstance(net, LiftedModule) else []
        predictor = cls(model, [], dropout=dropout)
        predictor.load_state_dict(state_dict)
        return predictor

    def _member_draws(self, member: _Member, count: int, args: tuple, kwargs: dict) -> dict:
        if member.guide is None:
            return {name: value.detach().cpu() for name, value in member.samples.items()}
        if count == 0:
            return {
                name: value.detach().cpu().unsqueeze(0) for name, value in member.median.items()
            }
        batch_args, batch_kwargs = Minibatches(tuple(args), dict(kwargs)).peek()
        _set_up(member.guide, batch_args, batch_kwargs)
        guide = poutine.substitute(member.guide, data=member.guide_params)
        return kept_draws(
            lambda: {
                name: value
                for name, value in guide_draw(guide, *batch_args, **batch_kwargs).items()
                if name in member.median
            },
            count,
        )

    def _member_probs(self, member: _Member, args: tuple, kwargs: dict) -> torch.Tensor:
        model = poutine.substitute(self.model, data=member.model_params)
        if member.guide is None:
            return predict_proba(model, *args, samples=member.samples, **kwargs)
        if self.num_samples == 0:
            mean = {name: value.unsqueeze(0) for name, value in member.median.items()}
            return predict_proba(model, *args, samples=mean, **kwargs)
        _set_up(member.guide, args, kwargs)
        guide = poutine.substitute(member.guide, data=member.guide_params)
        return predict_proba(model, *args, guide=guide, num_samples=self.num_samples, **kwargs)


def mle(
    model: Callable,
    *args,
    num_steps: int,
    net: LiftedModule | None = None,
    lr: float = 5e-4,
    schedule: str = "linear",
    warmup_ratio: float = 0.06,
    progress: bool = True,
    **kwargs,
) -> Predictor:
    """Maximum-likelihood LoRA fine-tuning (the "MLE" row): AdamW on the likelihood.

    Example::

        predictor = mle(model, train_loader, len(train_set), num_steps=5000)
        probs = predictor(test_batch, len(train_set))   # (1, B, C)

    :param callable model: a Pyro model that calls ``net`` and returns logits.
    :param args: the model's arguments (DataLoaders stand for minibatches).
    :param int num_steps: optimisation steps.
    :param LiftedModule net: the lifted peft model (default ``model.net``).
    :param float lr: AdamW's peak learning rate (Table 3: 5e-4 RoBERTa, 1e-4 Llama2).
    :param str schedule: ``"linear"`` decay after the warm-up (Table 3) or ``"constant"``.
    :param float warmup_ratio: fraction of the steps of linear warm-up (Table 3: 0.06).
    :param bool progress: show a progress bar.
    """
    return map_estimate(
        model,
        *args,
        num_steps=num_steps,
        net=net,
        lr=lr,
        weight_decay=0.0,
        schedule=schedule,
        warmup_ratio=warmup_ratio,
        progress=progress,
        **kwargs,
    )


def map_estimate(
    model: Callable,
    *args,
    num_steps: int,
    net: LiftedModule | None = None,
    lr: float = 5e-4,
    weight_decay: float = 1e-5,
    schedule: str = "linear",
    warmup_ratio: float = 0.06,
    progress: bool = True,
    **kwargs,
) -> Predictor:
    """LoRA fine-tuning with AdamW weight decay (the "MAP" row: decay 1e-5 in the paper).

    The decoupled decay stands for the Gaussian prior, as in the paper; for the MAP of the
    lifted prior itself use :func:`~pyro_bdl.inference.fit_map` with ``mle=False``.

    LoRA dropout is on only in training mode, and :func:`~pyro_bdl.models.lora_model`
    returns its model in eval mode: call ``lora.train()`` before fitting to fine-tune with
    the dropout, as the papers do (and ``lora.eval()`` after, for prediction). The
    predictor's :meth:`~Predictor.point` is the fine-tune's weights, e.g. for
    :func:`~pyro_bdl.inference.fit_laplace_lora`'s ``map=``; the module's own adapter
    weights are left as they were.

    Example::

        lora.train()
        predictor = map_estimate(lora.model, train_loader, len(train_set), num_steps=500)
        lora.eval()
        guide, link, _ = fit_laplace_lora(lora.model, train_loader, len(train_set),
                                          validation_loader, map=predictor.point())

    :param float weight_decay: AdamW's decoupled weight decay.

    The other parameters are :func:`mle`'s.
    """
    net = _lifted(model, net)
    optimizer = adamw(
        lr, weight_decay, num_steps=num_steps, schedule=schedule, warmup_ratio=warmup_ratio
    )
    member = _fit_point(model, net, args, kwargs, num_steps, optimizer, progress)
    return Predictor(model, [member], dropout=_lora_dropout(net))


def mc_dropout(
    model: Callable,
    *args,
    num_steps: int,
    net: LiftedModule | None = None,
    lr: float = 5e-4,
    num_samples: int = 10,
    schedule: str = "linear",
    warmup_ratio: float = 0.06,
    progress: bool = True,
    **kwargs,
) -> Predictor:
    """Maximum likelihood with the LoRA dropout on, in training and at prediction ("MCD").

    The peft model needs a LoRA dropout (``LoraConfig(lora_dropout=0.1)`` in the paper);
    only the LoRA dropout layers are switched on, the base model keeps its own mode.

    :param int num_samples: dropout passes per prediction (10 in the paper).

    The other parameters are :func:`mle`'s.
    """
    net = _lifted(model, net)
    dropout = _lora_dropout(net)
    if not dropout:
        raise ValueError(
            "mc_dropout: the peft model has no LoRA dropout; build it with "
            "LoraConfig(..., lora_dropout=0.1)"
        )
    optimizer = adamw(lr, num_steps=num_steps, schedule=schedule, warmup_ratio=warmup_ratio)
    with _training_mode(dropout, True):
        member = _fit_point(model, net, args, kwargs, num_steps, optimizer, progress)
    member.samples = {
        name: value.expand(num_samples, *value.shape[1:]) for name, value in member.samples.items()
    }
    return Predictor(model, [member], dropout=dropout, mc_dropout=True)


def deep_ensemble(
    model: Callable,
    *args,
    num_steps: int,
    num_members: int = 3,
    net: LiftedModule | None = None,
    lr: float = 5e-4,
    seed: int = 0,
    schedule: str = "linear",
    warmup_ratio: float = 0.06,
    progress: bool = True,
    **kwargs,
) -> Predictor:
    """``num_members`` LoRA adapters fitted independently on one base model ("ENS").

    Member ``k`` starts from peft's own LoRA initialisation drawn with seed ``seed + k``
    (A Kaiming-uniform, B zero) and is fitted by maximum likelihood; the members differ
    only in their adapter weights, which the predictor keeps (the base model is shared).
    The module's adapter weights are restored afterwards. The paper averages the members'
    logits; like every predictor here this one returns each member's probabilities.

    :param int num_members: ensemble size :math:`K` (3 in the paper).
    :param int seed: seed of the first member's initialisation.

    The other parameters are :func:`mle`'s.
    """
    # peft loads transformers (seconds): import it only when an ensemble is built, so that
    # `import pyro_bdl.inference` stays light.
    from peft.tuners.lora import LoraLayer

    net = _lifted(model, net)
    if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 1:
        raise ValueError(f"deep_ensemble: num_members must be a positive int, got {num_members!r}")
    layers = [module for module in net.module.modules() if isinstance(module, LoraLayer)]
    if not layers:
        raise ValueError("deep_ensemble: the lifted module has no peft LoRA layer")
    members = []
    with _restored(net.module):
        for k in range(num_members):
            with torch.random.fork_rng():
                torch.manual_seed(seed + k)
                for layer in layers:
                    for adapter in layer.active_adapters:
                        layer.reset_lora_parameters(adapter, init_lora_weights=True)
            optimizer = adamw(lr, num_steps=num_steps, schedule=schedule, warmup_ratio=warmup_ratio)
            members.append(_fit_point(model, net, args, kwargs, num_steps, optimizer, progress))
    return Predictor(model, members, dropout=_lora_dropout(net))


def bbb(
    model: Callable,
    *args,
    num_steps: int,
    net: LiftedModule | None = None,
    lr: float = 5e-4,
    init_scale: float = math.log1p(math.exp(-3.0)),
    prior_std: float | None = 1.0,
    num_samples: int = 10,
    schedule: str = "linear",
    warmup_ratio: float = 0.06,
    progress: bool = True,
    **kwargs,
) -> Predictor:
    r"""Bayes by Backprop on the random LoRA weights ("BBB").

    A :class:`~pyro_bdl.inference.MeanFieldGuide` with :math:`s = \log(1 + e^\rho)`,
    :math:`\rho` starting at -3 (Bayesian-Torch's default, which the paper adopts) and the
    means at the module's weights, trained with AdamW on the minibatch ELBO with its
    closed-form KL (``TraceMeanField_ELBO``): no flipout, no KL re-weighting.

    :param float init_scale: the initial standard deviation.
    :param float prior_std: the prior :math:`\mathcal{N}(0, \sigma^2)` of the fit
        (Bayesian-Torch's default 1; None keeps the network's prior).
    :param int num_samples: weight draws per prediction.

    The other parameters are :func:`mle`'s.
    """
    net = _lifted(model, net)
    _forget_point_weights(net)
    guide = MeanFieldGuide(model, init_scale=init_scale, scale_parametrization="softplus")
    _forget_params(type(guide).__name__ + ".")
    optimizer = adamw(lr, num_steps=num_steps, schedule=schedule, warmup_ratio=warmup_ratio)
    svi = SVI(model, guide, distributed.DataParallelOptim(optimizer), TraceMeanField_ELBO())
    batches = Minibatches(args, kwargs)
    bar = trange(num_steps, desc="BBB", disable=not progress, leave=False)
    with _prior(net, prior_std):
        for _ in bar:
            step_args, step_kwargs = batches.next()
            bar.set_postfix(loss=f"{svi.step(*step_args, **step_kwargs):.4g}", refresh=False)
    member = _guide_member(guide, net, batches)
    return Predictor(model, [member], num_samples=num_samples, dropout=_lora_dropout(net))


class TemperatureScaled:
    r"""A predictor whose every draw's probabilities are tempered by one scalar :math:`T`.

    Each draw's probabilities :math:`p_s` become :math:`\mathrm{softmax}(\log p_s / T)`
    (for a point estimate, the softmax of its logits divided by :math:`T`); :math:`T > 1`
    softens over-confident answers, :math:`T < 1` sharpens. Made by
    :func:`temperature_scaling`.

    :ivar predictor: the predictor tempered (returns ``(S, B, C)``).
    :ivar float temperature: :math:`T`.
    :ivar dict validation_nll: the validation NLL before (``T = 1``) and after the fit.
    """

    def __init__(self, predictor: Callable, temperature: float, validation_nll: dict):
        self.predictor = predictor
        self.temperature = temperature
        self.validation_nll = validation_nll

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """Tempered probabilities ``(S, B, C)`` for a batch (the predictor's arguments)."""
        return _tempered(_log_probs(self.predictor(*args, **kwargs)), 1.0 / self.temperature)

    def __repr__(self) -> str:
        return f"TemperatureScaled(temperature={self.temperature:.4g})"


def temperature_scaling(
    predictor: Callable,
    validation_loader: Iterable,
    *args,
    min_temperature: float = 0.05,
    max_temperature: float = 20.0,
    **kwargs,
) -> TemperatureScaled:
    r"""Temperature scaling: the one scalar :math:`T` with the lowest validation NLL.

    The baseline that Bayesian methods must beat on calibration (Guo et al., 2017; it is
    competitive with Bayesian adapters on NLL and ECE in recent LLM benchmarks): the
    fitted predictor's accuracy is unchanged (dividing by :math:`T` keeps every argmax),
    only its confidence moves. :math:`T` minimises the NLL of the tempered predictive
    :math:`\frac1S \sum_s \mathrm{softmax}(\log p_s / T)` on held-out batches, by
    golden-section search over :math:`\log T` in ``[min_temperature, max_temperature]``
    (for one draw the NLL is convex in :math:`1/T`, so the search finds the optimum).

    The bound keeps :math:`T` finite: a model no better than chance on the validation
    data is best served by :math:`T \to \infty`, every answer uniform. A fit that ends on
    ``max_temperature`` warns, since its answers are then near-uniform: the
    calibration is that of guessing, and the fine-tune needs fixing first.

    **References**

    1. *On Calibration of Modern Neural Networks*, C. Guo, G. Pleiss, Y. Sun,
       K. Q. Weinberger (ICML 2017)

    Example::

        predictor = map_estimate(lora.model, train_loader, len(train_set), num_steps=500)
        scaled = temperature_scaling(predictor, validation_loader, len(train_set))
        probs = scaled(test_batch, len(train_set))              # (1, B, C)
        scaled.temperature, scaled.validation_nll

    :param callable predictor: returns probabilities ``(S, B, C)`` for a batch (a
        :class:`Predictor`, or any method's predictive).
    :param validation_loader: held-out batches, each a dict with ``"labels"`` (never the
        test data); each is passed to ``predictor`` as its first argument.
    :param args: the predictor's other arguments (e.g. ``num_data``).
    :param float min_temperature: the lowest :math:`T` searched.
    :param float max_temperature: the highest :math:`T` searched.
    :param kwargs: the predictor's keyword arguments.
    :raises ValueError: for bounds that are not ``0 < min_temperature < max_temperature``
        or a loader without labels.
    """
    low = _checks.real("min_temperature", min_temperature, positive=True)
    high = _checks.real("max_temperature", max_temperature, positive=True)
    if not low < high:
        raise ValueError(
            f"temperature_scaling: min_temperature ({low}) must be below max_temperature ({high})"
        )
    log_probs, labels = _validation_log_probs(predictor, validation_loader, args, kwargs)

    def nll(log_temperature: float) -> float:
        probs = _tempered(log_probs, math.exp(-log_temperature)).mean(0)
        return -float(probs[torch.arange(len(labels)), labels].clamp_min(1e-30).log().mean())

    log_t = _golden_section(nll, math.log(low), math.log(high))
    temperature = math.exp(log_t)
    if log_t > math.log(high) - 0.01:
        confidence = float(_tempered(log_probs, 1.0 / temperature).mean(0).amax(-1).mean())
        warnings.warn(
            f"temperature_scaling: the validation NLL is lowest at max_temperature={high:g} "
            f"(and would fall further above it): every answer is near-uniform (mean top "
            f"probability {confidence:.3f} with {log_probs.shape[-1]} choices), the "
            "calibration of guessing. The predictor does no better than chance on the "
            "validation data; check that the fine-tune learns (accuracy above the majority "
            "class), or raise max_temperature to accept uniform answers",
            stacklevel=2,
        )
    elif log_t < math.log(low) + 0.01:
        warnings.warn(
            f"temperature_scaling: the validation NLL is lowest at min_temperature={low:g}; "
            "the predictor is far under-confident. Lower min_temperature to search further",
            stacklevel=2,
        )
    return TemperatureScaled(predictor, temperature, {"T=1": nll(0.0), "fitted": nll(log_t)})


def _log_probs(probs: torch.Tensor) -> torch.Tensor:
    if probs.dim() != 3:
        raise ValueError(
            f"temperature_scaling: the predictor must return (S, B, C) probabilities, got "
            f"shape {tuple(probs.shape)}"
        )
    return probs.clamp_min(torch.finfo(probs.dtype).tiny).log()


def _tempered(log_probs: torch.Tensor, inverse_temperature: float) -> torch.Tensor:
    return torch.softmax(log_probs * inverse_temperature, dim=-1)


def _validation_log_probs(
    predictor: Callable, loader: Iterable, args: tuple, kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log probabilities ``(S, N, C)`` and labels ``(N,)`` of every validation batch."""
    log_probs, labels = [], []
    with torch.no_grad():
        for batch in loader:
            if not isinstance(batch, Mapping) or "labels" not in batch:
                raise ValueError(
                    "temperature_scaling: validation_loader must give dicts with 'labels' "
                    "(the collators of pyro_bdl.data.tokenize make them)"
                )
            log_probs.append(_log_probs(predictor(batch, *args, **kwargs)).cpu())
            labels.append(batch["labels"].cpu())
    if not labels:
        raise ValueError("temperature_scaling: validation_loader gave no batches")
    return torch.cat(log_probs, dim=1), torch.cat(labels)


def _golden_section(f: Callable[[float], float], a: float, b: float, steps: int = 60) -> float:
    """The minimiser of a unimodal ``f`` on ``[a, b]`` (to ``0.618 ** steps`` of its width)."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    # the end points too: the optimum on a bound is the case the caller warns about
    return min((a, b, (a + b) / 2), key=f)


def adamw(
    lr: float,
    weight_decay: float = 0.0,
    *,
    num_steps: int,
    schedule: str = "linear",
    warmup_ratio: float = 0.06,
) -> pyro.optim.PyroOptim:
    """AdamW with the warm-up and decay of the recipe, as a ``pyro.optim`` optimiser.

    The learning rate of step :math:`t` is ``lr * warmup_schedule(t, num_steps,
    warmup_ratio, schedule)`` (:func:`~pyro_bdl.inference.vi.blob_svi.warmup_schedule`,
    BLoB's own). Pyro keeps one torch optimiser per parameter; each advances its schedule
    at its own step, and every weight steps once per SVI step.

    Example::

        optimizer = adamw(5e-4, num_steps=2000)
        svi = SVI(model, guide, optimizer, Trace_ELBO())

    :param float lr: the peak learning rate.
    :param float weight_decay: decoupled weight decay.
    :param int num_steps: the length of the run.
    :param str schedule: ``"linear"`` or ``"constant"`` after the warm-up.
    :param float warmup_ratio: fraction of the steps of linear warm-up.
    """
    factor = _schedule(num_steps, schedule, warmup_ratio)
    lr = _checks.real("lr", lr, positive=True)
    weight_decay = _checks.real("weight_decay", weight_decay, non_negative=True)
    return pyro.optim.PyroOptim(
        _ScheduledAdamW,
        {"lr": lr, "eps": _ADAM_EPS, "weight_decay": weight_decay, "lr_lambda": factor},
    )


def _schedule(num_steps: int, schedule: str, warmup_ratio: float) -> Callable[[int], float]:
    """The recipe's learning-rate multiplier of step ``t``, checked."""
    num_steps = _checks.integer("num_steps", num_steps, low=1)
    _checks.one_of("schedule", schedule, ("linear", "constant"))
    warmup_ratio = _checks.probability("warmup_ratio", warmup_ratio, open_high=True)
    return lambda step: warmup_schedule(step, num_steps, warmup_ratio, schedule)


class _ScheduledAdamW(torch.optim.AdamW):
    """AdamW that steps its own ``LambdaLR`` after each update (one per Pyro parameter)."""

    def __init__(self, params, lr_lambda: Callable[[int], float], **options):
        super().__init__(params, **options)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self, lr_lambda)

    def step(self, closure=None):
        loss = super().step(closure)
        self.schedule.step()
        return loss


def _set_up(guide: Callable, args: tuple, kwargs: dict) -> None:
    """Set up a guide member that load_state_dict built afresh (its parameters must exist
    before its saved values are substituted for them); a fitted one is left alone."""
    if guide.prototype_trace is None:  # a draw that changes nothing, not even the seed
        with torch.no_grad(), torch.random.fork_rng(), poutine.block():
            guide(*args, **kwargs)


def _lifted(model: Callable, net: LiftedModule | None) -> LiftedModule:
    net = net if net is not None else getattr(model, "net", None)
    if not isinstance(net, LiftedModule):
        raise TypeError(
            "pass net=<the LiftedModule the model calls> (made by bdl.lift(peft_model, ...)), "
            f"got {type(net).__name__}"
        )
    return net


def _lora_dropout(net: LiftedModule) -> list[torch.nn.Module]:
    return [
        module
        for name, module in net.module.named_modules()
        if "lora_dropout" in name and isinstance(module, torch.nn.Dropout) and module.p > 0
    ]


def _fit_point(
    model: Callable,
    net: LiftedModule,
    args: tuple,
    kwargs: dict,
    num_steps: int,
    optimizer: pyro.optim.PyroOptim,
    progress: bool,
) -> _Member:
    """Fit every random and point weight by (weight-decayed) maximum likelihood."""
    _forget_point_weights(net)
    fitted = fit_map(
        model,
        *args,
        num_steps=num_steps,
        optimizer=optimizer,
        mle=True,
        progress=progress,
        **kwargs,
    )
    samples = {name: value.unsqueeze(0) for name, value in fitted.items()}
    return _Member(model_params=_point_weights(net), samples=samples)


def _guide_member(guide: MeanFieldGuide, net: LiftedModule, batches: Minibatches) -> _Member:
    """A copy of a fitted guide's parameters and of the network's point weights."""
    args, kwargs = batches.peek()
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
    guide_params = {
        name: site["value"].detach().clone()
        for name, site in guide_trace.nodes.items()
        if site["type"] == "param"
    }
    return _Member(
        model_params=_point_weights(net),
        guide=guide,
        guide_params=guide_params,
        median=guide.median(),
    )


def _point_weights(net: LiftedModule) -> dict[str, torch.Tensor]:
    store = pyro.get_param_store()
    return {site: store[site].detach().clone() for site in net.point_sites if site in store}


def _forget_point_weights(net: LiftedModule) -> None:
    # pyro.param(site, init) reads the store when the site is there: drop the last fit's
    # point weights so that this fit starts from the module's (a fresh LoRA B is zero).
    _forget_params(*net.point_sites)


def _forget_params(*names_or_prefixes: str) -> None:
    store = pyro.get_param_store()
    for name in list(store.keys()):
        if any(
            name == key or (key.endswith(".") and name.startswith(key)) for key in names_or_prefixes
        ):
            del store[name]


@contextlib.contextmanager
def _prior(net: LiftedModule, prior_std: float | None) -> Iterator[None]:
    """The network's prior is IIDNormal(prior_std) for the duration of one method's fit."""
    if prior_std is None:
        yield
        return
    previous, net.prior = net.prior, IIDNormal(prior_std)
    try:
        yield
    finally:
        net.prior = previous


@contextlib.contextmanager
def _training_mode(modules: Sequence[torch.nn.Module], training: bool) -> Iterator[None]:
    modes = [module.training for module in modules]
    for module in modules:
        module.train(training)
    try:
        yield
    finally:
        for module, mode in zip(modules, modes):
            module.train(mode)


@contextlib.contextmanager
def _restored(module: torch.nn.Module) -> Iterator[None]:
    saved: Mapping[str, torch.Tensor] = {
        name: param.detach().clone()
        for name, param in module.named_parameters()
        if param.requires_grad
    }
    try:
        yield
    finally:
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
