r"""A single-layer LSTM with one gate bias, written for ``torch.func``.

We do not use :class:`torch.nn.LSTM` for two reasons. Its fused kernels have no
:func:`torch.func.vmap` batching rule (pytorch/pytorch#105982): ``vmap`` either fails or
falls back to a slow per-example loop, and per-example gradients (the diagonal empirical
Fisher of the Laplace guides) need ``vmap``. And it keeps two bias vectors
(``bias_ih`` and ``bias_hh``) where Keras, in which the CNN-LSTM of the cold-posterior
experiments was written, keeps one, so ``nn.LSTM`` would give that model 512 parameters
too many (2,700,610 instead of 2,700,098) and put a prior on a redundant direction.

The recurrence is that of ``nn.LSTM`` with :math:`b = b_{ih} + b_{hh}`:

.. math::

    (i_t, f_t, g_t, o_t) &= W_{ih} x_t + W_{hh} h_{t-1} + b, \\
    c_t &= \sigma(f_t) \odot c_{t-1} + \sigma(i_t) \odot \tanh(g_t), \\
    h_t &= \sigma(o_t) \odot \tanh(c_t),

with :math:`h_0 = c_0 = 0`. The input projection of every step is one matrix product
before the loop, so each step costs one fused matrix product for all four gates.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LSTM"]


class LSTM(nn.Module):
    r"""One LSTM layer over a batch-first sequence, with a single gate bias.

    Parameters are laid out as in :class:`torch.nn.LSTM` (gates in the order input,
    forget, cell, output), so ``weight_ih`` and ``weight_hh`` are ``nn.LSTM``'s
    ``weight_ih_l0`` and ``weight_hh_l0`` and ``bias`` is ``bias_ih_l0 + bias_hh_l0``.
    They are initialised as ``nn.LSTM`` initialises its own: uniform on
    :math:`\pm 1/\sqrt{H}`.

    Example::

        lstm = LSTM(input_size=64, hidden_size=128)
        outputs, (h, c) = lstm(torch.randn(32, 24, 64))   # outputs: (32, 24, 128)

    :param int input_size: features per step, :math:`I`.
    :param int hidden_size: state size, :math:`H`.
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        for name, value in (("input_size", input_size), ("hidden_size", hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LSTM: {name} must be a positive int, got {value!r}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(4 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for param in self.parameters():
            nn.init.uniform_(param, -bound, bound)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Run the recurrence over ``x`` of shape ``(B, T, I)``.

        :return: the hidden states of every step ``(B, T, H)`` and the last ``(h_T, c_T)``,
            each ``(B, H)``, as ``nn.LSTM(batch_first=True)`` returns them (without the
            layer dimension).
        """
        if x.dim() != 3 or x.shape[1] < 1 or x.shape[-1] != self.input_size:
            raise ValueError(
                f"LSTM: input must have shape (batch, steps >= 1, {self.input_size}), got "
                f"{tuple(x.shape)}"
            )
        input_gates = nn.functional.linear(x, self.weight_ih, self.bias)
        h = x.new_zeros(x.shape[0], self.hidden_size)
        c = torch.zeros_like(h)
        outputs = []
        for t in range(x.shape[1]):
            gates = torch.addmm(input_gates[:, t], h, self.weight_hh.T)
            i, f, g, o = gates.chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, dim=1), (h, c)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}"
