r"""IVON's training step: Algorithm 1 of Shen et al. (2024), as the authors' ``ivon-opt`` does it.

One step on a minibatch, with :math:`\bar\ell` the minibatch's mean negative log likelihood
per data point (:math:`-\frac{1}{N}` times the likelihood that ``bdl.observe`` scales by
:math:`N/B`), :math:`\lambda` the effective sample size and :math:`\delta` the weight decay
of :class:`~pyro_bdl.inference.IVONGuide`:

.. math::

    \hat g &= \nabla \bar\ell(\theta), \quad \theta = m + \epsilon, \quad
        \epsilon \sim \mathcal{N}(0, 1 / (\lambda (h + \delta)))
        \qquad \text{(averaged over MC samples)} \\
    \hat h &= \hat g \cdot \epsilon\, \lambda (h + \delta)
        \qquad \text{(Price's theorem: } \mathbb{E}[\hat h] = \mathbb{E}_q[\mathrm{diag}\,
        \nabla^2 \bar\ell]) \\
    g &\leftarrow \beta_1 g + (1 - \beta_1) \hat g \\
    h &\leftarrow \beta_2 h + (1 - \beta_2) \hat h
        + \tfrac12 (1 - \beta_2)^2 (h - \hat h)^2 / (h + \delta) \\
    m &\leftarrow m - \alpha (h_0 + \delta)\, \mathrm{clip}_\rho\Big(
        \frac{g / (1 - \beta_1^t) + \delta (m - \mu)}{h + \delta}\Big)

The last term of the :math:`h` update keeps :math:`h + \delta` positive; the learning rate
is rescaled by :math:`h_0 + \delta` so that the first step is an SGD step of size
:math:`\alpha`; :math:`\mathrm{clip}_\rho` clips each coordinate to :math:`[-\rho, \rho]`;
:math:`\mu` is the prior mean (0 in the paper). These are the defaults of ``ivon-opt``
(``rescale_lr=True``, ``debias=True``, ``hess_approx="price"``), whose order of operations
this follows, so that with the same seed both draw the same noise and take the same steps.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from tqdm.auto import trange

from pyro_bdl import _checks, distributed
from pyro_bdl.inference.log_joint import LogJoint
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.vi.blob_svi import warmup_schedule
from pyro_bdl.inference.vi.ivon import IVONGuide

__all__ = ["IVONSVI", "fit_ivon"]

#: ``fit_ivon``'s default :math:`\beta_2 = 1 - c / T` over :math:`T` steps leaves
#: :math:`e^{-c}` (under 1%) of ``hess_init`` in :math:`h` at the end.
FORGET_STEPS = 5.0
#: The range of the :math:`\beta_2` that ``fit_ivon`` chooses: the largest is ``ivon-opt``'s
#: default; below the smallest one estimate is a tenth of :math:`h`, too noisy.
BETA2_MIN, BETA2_MAX = 0.9, 0.99999
#: ``fit_ivon`` warns when ``hess_init`` still makes up more than this share of :math:`h`.
HESS_INIT_SHARE = 0.1


class IVONSVI:
    r"""IVON steps of an :class:`~pyro_bdl.inference.IVONGuide`, one minibatch at a time.

    Like :class:`pyro.infer.SVI`, :meth:`step` takes the model's arguments for one
    minibatch. A step costs ``mc_samples`` forward and backward passes of the model and a
    few element-wise operations over the flat vectors of :math:`m` and :math:`h`; it
    never waits for the device (the loss comes back as a tensor). The guide holds
    :math:`m` and :math:`h`; this object holds the momentum :math:`g` and the step count.
    Point weights of the model (``pyro.param`` sites) keep their values.

    A step in parts, for gradient accumulation (as the Hugging Face Trainer's
    :class:`~pyro_bdl.hf.IVONTrainer` takes its steps): :meth:`accumulate` once per
    microbatch, then :meth:`update`. The microbatches of a step share its weight draws
    :math:`\epsilon`; their :math:`\hat g` and :math:`\hat g \cdot \epsilon` are averaged
    (and across the ranks of a ``torchrun`` job), so that :math:`k` microbatches of
    :math:`B` take the step of one batch of :math:`kB`, Hessian estimate included. Between
    the two, ``m.grad`` holds :math:`\hat g` and ``h.grad`` holds :math:`\hat g \cdot
    \epsilon` (``guide.loc`` and ``guide.hess``), so that whatever acts on gradients
    between the backward passes and a step (a loss scaler's unscaling) acts on them.
    With ``max_grad_norm`` :math:`\hat g` is clipped to that norm before the update, as
    plain training clips its weights' gradient; :math:`\hat h` is not.

    **References**

    [1] Y. Shen et al., "Variational Learning is Effective for Large Deep Networks",
    ICML 2024, Algorithm 1; and the authors' ``ivon-opt`` (``ivon/_ivon.py``).

    Example::

        guide = IVONGuide(model)
        svi = IVONSVI(model, guide, lr=0.1)
        for batch in batches:
            loss = svi.step(batch, num_data)

    :param callable model: a Pyro model with a ``bdl.observe`` likelihood.
    :param IVONGuide guide: the guide to train.
    :param float lr: the learning rate :math:`\alpha \ge 0`.
    :param float beta1: the momentum's decay :math:`\beta_1 \in [0, 1)`.
    :param float beta2: the Hessian estimate's decay :math:`\beta_2 \in [0, 1]`
        (``ivon-opt``'s default; :func:`fit_ivon` chooses it from the run's length, since
        :math:`h` keeps :math:`\beta_2^t` of ``hess_init`` after :math:`t` steps).
    :param int mc_samples: weight draws per step, their gradients averaged.
    :param float clip_radius: :math:`\rho > 0`, the clip of each coordinate of the
        preconditioned update (``inf``: none, as in ``ivon-opt``).
    :param callable schedule: ``t -> multiplier`` of ``lr`` at step ``t`` (from 0), e.g.
        a cosine decay; see :mod:`~pyro_bdl.inference.sgmcmc.schedules`.
    :param float max_grad_norm: clip :math:`\hat g` to this norm (None: no clip).
    :param callable backward: how a loss is back-propagated (default ``loss.backward()``;
        the Trainer passes its ``accelerator.backward``, which scales fp16 losses).
    """

    layout = "training"  # bdl.save keeps the guide and the optimiser (persistence.py)

    def __init__(
        self,
        model: Callable,
        guide: IVONGuide,
        *,
        lr: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.99999,
        mc_samples: int = 1,
        clip_radius: float = math.inf,
        schedule: Callable[[int], float] | None = None,
        max_grad_norm: float | None = None,
        backward: Callable[[torch.Tensor], None] | None = None,
    ):
        self.model = _checks.function("model", model, "a Pyro model (a callable)")
        self.guide = _checks.instance("guide", guide, IVONGuide, "an IVONGuide")
        self.lr = _checks.real("lr", lr, non_negative=True)
        self.beta1 = _checks.probability("beta1", beta1, open_high=True)
        self.beta2 = _checks.probability("beta2", beta2)
        self.mc_samples = _checks.integer("mc_samples", mc_samples, low=1)
        self.clip_radius = _checks.real("clip_radius", clip_radius, positive=True, finite=False)
        if schedule is not None:
            _checks.function("schedule", schedule, "a callable t -> learning-rate multiplier")
        self.schedule = schedule
        if max_grad_norm is not None:
            max_grad_norm = _checks.real("max_grad_norm", max_grad_norm, positive=True)
        self.max_grad_norm = max_grad_norm
        if backward is not None:
            _checks.function("backward", backward, "a callable loss -> None")
        self.backward = backward or torch.Tensor.backward
        self.momentum: torch.Tensor | None = None
        self.step_count = 0
        self._window: _Draws | None = None  # the step being accumulated
        #: :math:`\beta_2^t`: the weight that ``hess_init`` still has in :math:`h`
        self.hess_init_weight = 1.0

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Take one step on the minibatch that ``args`` and ``kwargs`` hold.

        :return: the mean over the MC samples of :math:`\\bar\\ell(\\theta)`, a 0-d tensor
            on the model's device.
        """
        self.accumulate(*args, **kwargs)
        return self.update()["loss"]

    def accumulate(self, *args, **kwargs) -> torch.Tensor:
        """Add one microbatch's :math:`\\hat g` and :math:`\\hat g \\cdot \\epsilon`, at the
        step's weight draws (drawn by its first microbatch), to the step being accumulated.

        :return: the microbatch's mean over the MC samples of :math:`\\bar\\ell(\\theta)`.
        """
        if self.momentum is None:
            self._setup(args, kwargs)
        if self._window is None:
            self._window = self._draw()
        m, h = self.guide.loc.unconstrained(), self.guide.hess.unconstrained()
        loss = 0.0
        for noise in self._window.noises:
            theta = (m.detach() + noise).requires_grad_()
            sample_loss = self._loss(theta, args, kwargs)
            if sample_loss.requires_grad:  # else the likelihood ignores the weights
                self.backward(sample_loss)
                with torch.no_grad():
                    m.grad.add_(theta.grad)
                    h.grad.addcmul_(noise, theta.grad)
            loss = loss + sample_loss.detach()
        self._window.add(loss)
        return loss / self.mc_samples

    def reduce_gradients(self) -> None:
        """Average :math:`\\hat g` and :math:`\\hat g \\cdot \\epsilon` over the MC samples,
        the step's microbatches and the ranks (:meth:`update` calls it; a loop that
        checks the gradients before the update calls it first)."""
        window = self._window
        if window is None or window.reduced:
            return
        m, h = self.guide.loc.unconstrained(), self.guide.hess.unconstrained()
        # sums over every MC sample of every microbatch
        distributed.mean_of_sums_([m.grad, h.grad, window.loss], window.count * self.mc_samples)
        window.reduced = True

    def update(self, lr: float | None = None) -> dict[str, torch.Tensor]:
        """Take the step with the microbatches accumulated since the last update.

        :param float lr: the learning rate of this step (default ``lr`` times the
            schedule's multiplier; the Trainer passes its scheduler's).
        :return: ``{"loss": ...}``, the step's mean :math:`\\bar\\ell(\\theta)` (and, with
            ``max_grad_norm``, ``"grad_norm"``, the norm of :math:`\\hat g` before the clip).
        """
        if self._window is None:
            raise RuntimeError("IVONSVI.update: call accumulate(...) with a microbatch first")
        self.reduce_gradients()
        window, self._window = self._window, None
        m, h = self.guide.loc.unconstrained(), self.guide.hess.unconstrained()
        record = {"loss": window.loss}
        if self.max_grad_norm is not None:
            record["grad_norm"] = torch.nn.utils.clip_grad_norm_([m], self.max_grad_norm)
        if lr is None:
            lr = self.lr * (self.schedule(self.step_count) if self.schedule is not None else 1.0)
        with torch.no_grad():
            self._update(m, h, m.grad, h.grad, window.precision, lr)
        m.grad, h.grad = None, None
        return record

    def grad_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` :meth:`accumulate` fills: :math:`m` and :math:`h`
        (empty before the first microbatch)."""
        if self.momentum is None:
            return []
        return [self.guide.loc.unconstrained(), self.guide.hess.unconstrained()]

    def _setup(self, args: tuple, kwargs: dict) -> None:
        self.guide._ensure_setup(*args, **kwargs)
        point = self.guide.point_sites
        if point:
            made_by = getattr(getattr(self.model, "net", None), "made_by", "lift")
            fix = (
                "Build the model with lora_model(..., adapters_random='AB', head='random')"
                if made_by == "lora_model"
                else "Lift them as random weights"
            )
            warnings.warn(
                f"IVONSVI trains the model's random sites only; its point weights {point[:3]}"
                f"{' ...' if len(point) > 3 else ''} (pyro.param) keep their values. {fix} "
                "to train them with IVON",
                stacklevel=4,
            )
        self.momentum = torch.zeros_like(self.guide.loc.unconstrained())
        distributed.broadcast_([self.guide.loc.unconstrained(), self.guide.hess.unconstrained()])

    def _draw(self) -> _Draws:
        """The step's weight noise, :math:`\\epsilon \\sim \\mathcal{N}(0, 1 / (\\lambda (h +
        \\delta)))` per MC sample, and the precision :math:`h + \\delta` it was drawn at."""
        guide = self.guide
        m, h = guide.loc.unconstrained(), guide.hess.unconstrained()
        with torch.no_grad():
            precision = h + guide._delta
            scale = (precision * guide.ess).rsqrt_()
            # The draws of ivon-opt: one randn over all weights per sample, in the sites' order.
            noises = [
                torch.randn(m.shape, dtype=m.dtype, device=m.device).mul_(scale)
                for _ in range(self.mc_samples)
            ]
        distributed.broadcast_(noises)  # data-parallel: rank 0's draws everywhere
        # the sums of the step's gradients start here
        m.grad, h.grad = torch.zeros_like(m), torch.zeros_like(h)
        return _Draws(noises, precision)

    def state_dict(self) -> dict:
        """The training state (momentum :math:`g`, step count and the weight of ``hess_init``
        in :math:`h`) to resume step for step.

        The guide holds :math:`m` and :math:`h` (its own ``state_dict``); ``bdl.save(svi,
        directory)`` writes both.
        """
        momentum = None if self.momentum is None else self.momentum.detach().clone()
        return {
            "step_count": self.step_count,
            "momentum": momentum,
            "hess_init_weight": self.hess_init_weight,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict` (the momentum on the guide's device)."""
        momentum = state["momentum"]
        if momentum is not None and self.guide.prototype_trace is not None:
            momentum = momentum.to(self.guide.loc.unconstrained())
        self.momentum, self.step_count = momentum, int(state["step_count"])
        # a state saved before the weight was kept: beta2^t, exact for a constant beta2
        self.hess_init_weight = float(state.get("hess_init_weight", self.beta2**self.step_count))

    def _init_settings(self) -> dict:
        # the constructor's arguments, for bdl.save
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "mc_samples": self.mc_samples,
            "clip_radius": self.clip_radius,
            "schedule": self.schedule,
            "max_grad_norm": self.max_grad_norm,
        }

    def _loss(self, theta: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """:math:`\\bar\\ell(\\theta)`: minus the likelihood (scaled to N) over N, with the
        log priors that are not IVON's weight decay and the log-Jacobian of constrained
        sites (see :class:`~pyro_bdl.inference.IVONGuide`)."""
        guide = self.guide
        values, log_jacobian = guide.sites.constrain(guide._unflatten(theta))
        with LogJoint(values, likelihood_only=guide.closed_form_priors) as likelihood:
            self.model(*args, **kwargs)
        if not likelihood.observed:
            raise ValueError(
                "IVONSVI: the model observes nothing; IVON trains on a likelihood "
                "(bdl.observe(name, distribution, obs=labels, num_data=N))"
            )
        return -(likelihood.value + log_jacobian) / guide.num_data

    def _update(
        self,
        m: torch.Tensor,
        h: torch.Tensor,
        grad: torch.Tensor,
        noise_grad: torch.Tensor,
        precision: torch.Tensor,
        lr: float,
    ) -> None:
        """Algorithm 1's update in place, given the averaged :math:`\\hat g` and
        :math:`\\hat g \\cdot \\epsilon`; ``precision`` is the :math:`h + \\delta` of the draw."""
        guide, beta1, beta2 = self.guide, self.beta1, self.beta2
        delta = guide._delta
        self.step_count += 1
        self.hess_init_weight *= beta2
        self.momentum.mul_(beta1).add_(grad, alpha=1 - beta1)
        hess_nll = noise_grad.mul_(precision).mul_(guide.ess)
        correction = (h - hess_nll).square_().div_(precision)
        h.mul_(beta2).add_(hess_nll, alpha=1 - beta2).add_(correction, alpha=0.5 * (1 - beta2) ** 2)
        update = self.momentum.div(1 - beta1**self.step_count).addcmul_(delta, m)
        if guide._prior_shift is not None:
            update.sub_(guide._prior_shift)
        update.div_(h + delta)
        if math.isfinite(self.clip_radius):
            update.clamp_(-self.clip_radius, self.clip_radius)
        m.sub_(update.mul_(delta + guide.hess_init), alpha=lr)


class _Draws:
    """The step being accumulated: its weight noise, and the loss summed over its MC
    samples and microbatches."""

    def __init__(self, noises: list[torch.Tensor], precision: torch.Tensor):
        self.noises = noises
        self.precision = precision
        self.count = 0
        self.loss: torch.Tensor | None = None
        self.reduced = False

    def add(self, loss: torch.Tensor) -> None:
        self.count += 1
        self.loss = loss.clone() if self.loss is None else self.loss + loss


def fit_ivon(
    model: Callable,
    guide: IVONGuide,
    *args,
    num_steps: int,
    lr: float = 0.1,
    beta1: float = 0.9,
    beta2: float | None = None,
    mc_samples: int = 1,
    clip_radius: float = math.inf,
    schedule: Callable[[int], float] | str | None = "cosine",
    max_grad_norm: float | None = None,
    progress: bool = True,
    **kwargs,
) -> dict[str, list[float]]:
    r"""Train an :class:`~pyro_bdl.inference.IVONGuide` on minibatches (see :class:`IVONSVI`).

    DataLoader arguments are replaced by a fresh minibatch at every step. The loss is read
    from the device a hundred times per run, for the progress bar and to stop a run whose
    loss is no longer finite.

    The defaults fit the data's posterior in the run's ``num_steps``. :math:`h` is an
    exponential average that starts at ``hess_init``, which it still holds with weight
    :math:`\beta_2^t` after :math:`t` steps: at ``ivon-opt``'s :math:`\beta_2 = 0.99999`
    that is 97% after 3,000 steps, and the posterior's variances are ``hess_init``'s
    rather than the data's. So by default :math:`\beta_2 = 1 - 5 / T` over the run's
    :math:`T` steps (within [0.9, 0.99999]), which leaves :math:`e^{-5} < 1\%` of ``hess_init``
    at the end, and the learning rate decays to zero on a cosine (as in Shen et al.'s
    experiments), so that the last means are the optimum's and not one noisy step of it.
    Given ``beta2`` and ``schedule="constant"``, the steps are ``ivon-opt``'s. A fit whose
    :math:`h` still holds more than 10% of ``hess_init`` (by :math:`\beta_2^T`, or as a
    share of the final :math:`h + \delta`, median over the weights) warns.

    Example::

        guide = IVONGuide(model)
        history = fit_ivon(model, guide, train_loader, len(train_set), num_steps=5000)

    :param callable model: a Pyro model with a ``bdl.observe`` likelihood.
    :param IVONGuide guide: the guide to train.
    :param args: the model's arguments (DataLoaders stand for minibatches).
    :param int num_steps: training steps.
    :param float beta2: :math:`\beta_2` (default :math:`1 - 5 / T` within :math:`[0.9, 0.99999]`).
    :param schedule: ``t -> multiplier`` of ``lr`` (e.g. a warm-up,
        ``lambda t: warmup_schedule(t, num_steps, 0.06, "linear")`` with
        :func:`~pyro_bdl.inference.vi.blob_svi.warmup_schedule`), or ``"cosine"`` (from 1
        at the first step to 0 after the last: transformers' cosine schedule) or
        ``"constant"`` (``None`` too).
    :param bool progress: show a progress bar.
    :return: ``{"loss": [...]}``, the per-step loss of :meth:`IVONSVI.step`.
    :raises RuntimeError: if the loss stops being finite (the guide keeps that state).

    The other parameters are :class:`IVONSVI`'s.
    """
    num_steps = _checks.integer("num_steps", num_steps, low=1)
    svi = IVONSVI(
        model,
        guide,
        lr=lr,
        beta1=beta1,
        beta2=_default_beta2(num_steps) if beta2 is None else beta2,
        mc_samples=mc_samples,
        clip_radius=clip_radius,
        schedule=_learning_rate_schedule(schedule, num_steps),
        max_grad_norm=max_grad_norm,
    )
    batches = Minibatches(args, kwargs)
    losses: list[torch.Tensor] = []
    check_every = max(1, num_steps // 100)
    bar = trange(num_steps, desc="IVON", disable=not progress, leave=False)
    for step in bar:
        step_args, step_kwargs = batches.next()
        losses.append(svi.step(*step_args, **step_kwargs))
        if (step + 1) % check_every == 0 or step + 1 == num_steps:
            recent = float(torch.stack(losses[-check_every:]).mean())
            if not math.isfinite(recent):
                raise RuntimeError(
                    f"fit_ivon: the loss is {recent} by step {step + 1}; IVON diverged. Lower "
                    f"lr (now {lr}), raise hess_init (now {guide.hess_init}) or clip the update "
                    f"with clip_radius (now {clip_radius})"
                )
            bar.set_postfix(loss=f"{recent:.4g}", refresh=False)
    _warn_if_hess_init_remains(svi, num_steps)
    return {"loss": torch.stack(losses).tolist()}


def _default_beta2(num_steps: int) -> float:
    """``fit_ivon``'s :math:`\\beta_2` for a run of ``num_steps``: :math:`1 - 5 / T` within
    [0.9, 0.99999], so that :math:`h` keeps :math:`e^{-5}` of ``hess_init`` at the end.

    :param int num_steps: :math:`T`, the steps of the run.
    """
    num_steps = _checks.integer("num_steps", num_steps, low=1)
    return min(max(BETA2_MIN, 1.0 - FORGET_STEPS / num_steps), BETA2_MAX)


def _learning_rate_schedule(
    schedule: Callable[[int], float] | str | None, num_steps: int
) -> Callable[[int], float] | None:
    if callable(schedule) or schedule is None:
        return schedule
    _checks.one_of("schedule", schedule, ("cosine", "constant"))
    if schedule == "constant":
        return None
    return lambda t: warmup_schedule(t, num_steps, 0.0, "cosine")


def _warn_if_hess_init_remains(svi: IVONSVI, num_steps: int, caller: str = "fit_ivon") -> None:
    """Warn when ``hess_init`` still makes up much of :math:`h`: the variances are then the
    initial guess's, not the data's (one read of the device, after the run)."""
    guide = svi.guide
    remnant = guide.hess_init * svi.hess_init_weight
    with torch.no_grad():
        share = float((remnant / (guide.hess.unconstrained() + guide._delta)).median())
    if svi.hess_init_weight <= HESS_INIT_SHARE and share <= HESS_INIT_SHARE:
        return
    warnings.warn(
        f"{caller}: after num_steps={num_steps} steps at beta2={svi.beta2}, the Hessian "
        f"estimate h still holds {svi.hess_init_weight:.0%} of hess_init={guide.hess_init}, "
        f"which makes up {share:.0%} of the posterior precision h + delta (median over the "
        "weights): the posterior's variances are not yet the data's. Raise num_steps, lower "
        f"beta2 (the default for this run is {_default_beta2(num_steps):.4g}, "
        "1 - 5 / num_steps) or set hess_init near the data's curvature",
        stacklevel=3,
    )
