r"""LoRA flipout (BLoB, section 3.4 and Appendix A.3): independent weight noise per example.

A weight draw :math:`A = M + \Delta A`, :math:`\Delta A = E \circ \Omega`, shared by a whole
minibatch makes the examples' outputs correlated. Flipout multiplies :math:`\Delta A` by a
random rank-one sign pattern :math:`t_i s_i^\top` per example, which leaves each example's
distribution unchanged (the entries of :math:`\Delta A` are symmetric and independent) and
decorrelates the examples, for the price of one extra low-rank product (eq. 12 and 68):

.. math::

    Z = W_0 H + B\big(M H + [(E \circ \Omega)(H \circ S)] \circ T\big).

:class:`LoRAFlipout` computes the bracket at the LoRA A projection of a peft model in place
of the layer's forward (so the plain product :math:`A h` is not computed and thrown away),
and no per-example weight is ever formed. The hook acts only on forwards whose A is
the guide's latest draw, put in place by :func:`torch.func.functional_call` (a lifted
network's sample site): forwards with the module's own weight (``net.fixed(...)``) and
other inference on the same network (a Laplace fit, SGMCMC) are left alone.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from pyro_bdl._checks import instance
from pyro_bdl.lift import LiftedModule

__all__ = ["LoRAFlipout", "flipout_linear"]


def flipout_linear(h: torch.Tensor, mean: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    r"""The flipout output :math:`M h + [\Delta A (h \circ s)] \circ t` of a bias-free linear map.

    Every row of ``h`` (every example, and every token of a sequence) draws its own signs
    :math:`s \in \{\pm 1\}^n` and :math:`t \in \{\pm 1\}^r`.

    :param torch.Tensor h: inputs ``(..., n)``.
    :param torch.Tensor mean: the mean weight :math:`M`, ``(r, n)``.
    :param torch.Tensor delta: the weight noise :math:`\Delta A = E \circ \Omega`, ``(r, n)``.
    :return: outputs ``(..., r)``.
    """
    if not all(torch.is_tensor(x) for x in (h, mean, delta)):
        raise TypeError("flipout_linear: h, mean and delta must be tensors")
    if mean.dim() != 2 or delta.shape != mean.shape or h.shape[-1:] != mean.shape[1:]:
        raise ValueError(
            f"flipout_linear: mean and delta must both be (r, n) and h (..., n), got h "
            f"{tuple(h.shape)}, mean {tuple(mean.shape)}, delta {tuple(delta.shape)}"
        )
    # The signs as 2 b - 1 with bits b: s and t of a row come from one randint (exact and
    # several times faster than bernoulli_ on CPU) and enter fused products, since on a
    # deep network of narrow layers each kernel launch is a visible share of the step:
    # h o s = 2 (h o b_s) - h and M h + y o t = (M h - y) + 2 (y o b_t).
    n, r = h.shape[-1], delta.shape[0]
    bits = torch.randint(0, 2, h.shape[:-1] + (n + r,), dtype=h.dtype, device=h.device)
    bits_s, bits_t = bits.split((n, r), dim=-1)
    y = F.linear(torch.addcmul(-h, h, bits_s, value=2.0), delta)
    return torch.addcmul(F.linear(h, mean) - y, y, bits_t, value=2.0)


class LoRAFlipout:
    """Runs :func:`flipout_linear` at the LoRA A layers of a lifted network.

    While attached, each A layer's ``forward`` is replaced by one that computes flipout for
    a forward with the guide's draw and the plain ``linear`` otherwise (a method bound to
    the layer, so a deep copy of the model gets one bound to its own layer).

    The guide that samples A records each draw and the mean :math:`M` it sampled around
    (:meth:`record`); a forward whose A *is* that draw then uses :math:`\\Delta A = A - M`.
    Every other forward (the module's own weight, a value from elsewhere) runs unchanged.

    :param LiftedModule net: the lifted peft model.
    :param sites: the random sites whose weights are LoRA A matrices.
    :ivar dict draws: site -> the guide's latest draw.
    :ivar dict means: site -> the mean of that draw.
    """

    def __init__(self, net: LiftedModule, sites: Iterable[str]):
        instance("net", net, LiftedModule, "a LiftedModule made by bdl.lift")
        if isinstance(sites, str) or not isinstance(sites, Iterable):
            raise TypeError(f"sites must be an iterable of site names, got {sites!r}")
        sites = list(sites)
        unknown = [site for site in sites if site not in net.random_sites]
        if unknown:
            raise ValueError(
                f"sites must be random sites of net, got {unknown[:3]}; its random sites "
                f"include {list(net.random_sites)[:3]}"
            )
        self.draws: dict[str, torch.Tensor] = {}
        self.means: dict[str, torch.Tensor] = {}
        self._layers = {}
        for site in sites:
            layer, attribute = net.owner(site)
            if (
                not isinstance(layer, torch.nn.Linear)
                or attribute != "weight"
                or layer.bias is not None
            ):
                raise ValueError(
                    f"flipout: site {site!r} is not the weight of a bias-free nn.Linear (peft's "
                    f"lora_A), it is {attribute!r} of a {type(layer).__name__}; pass flipout=False"
                )
            self._layers[site] = layer
        self._attached = False

    def record(self, draws: dict[str, torch.Tensor], means: dict[str, torch.Tensor]) -> None:
        """Remember a draw of every site (and its means): the forwards flipout acts on."""
        self.draws, self.means = draws, means

    @property
    def attached(self) -> bool:
        """Whether flipout is in place at the layers."""
        return self._attached

    def attach(self) -> None:
        """Put flipout in place (once)."""
        for site, layer in self._layers.items():
            # a weak reference: a deep copy of the model shares it and never copies the draws
            layer._bdl_flipout = (weakref.ref(self), site)
            layer.forward = types.MethodType(_flipout_forward, layer)
        self._attached = True

    def detach(self) -> None:
        """Take flipout out: every layer runs as plain LoRA again.

        A layer that another guide's flipout has taken over since (a guide loaded in place
        of this one) keeps that flipout.
        """
        for layer in self._layers.values():
            reference, _ = layer.__dict__.get("_bdl_flipout", (None, None))
            if reference is not None and reference() is self:
                layer.__dict__.pop("forward", None)
                layer.__dict__.pop("_bdl_flipout", None)
        self._attached = False


def _flipout_forward(layer: torch.nn.Linear, h: torch.Tensor) -> torch.Tensor:
    reference, site = layer._bdl_flipout
    flipout, weight = reference(), layer.weight
    if flipout is None or weight is not flipout.draws.get(site):  # not the guide's draw
        return F.linear(h, weight)
    mean = flipout.means[site]
    return flipout_linear(h, mean, weight - mean)
