"""The warm-up adaptation is a component: chosen by ``new_adaptation`` from a method's
hyperparameter record, and driven here without a model or a kernel."""

import math

import pytest
import torch

from pyro_bdl.inference.sgmcmc.adaptation import Adaptation
from pyro_bdl.inference.sgmcmc.dense import DenseAdaptation
from pyro_bdl.inference.sgmcmc.hyperparameters import Hyperparameters
from pyro_bdl.inference.sgmcmc.sghmc import SGHMCHyperparameters
from pyro_bdl.inference.sgmcmc.sgnht import SGNHTHyperparameters
from pyro_bdl.inference.sgmcmc.warmup import new_adaptation

F64 = torch.float64


def _theta(dimension):
    return [torch.zeros(dimension, dtype=F64)]


@pytest.mark.parametrize(
    "hyper, warmup_steps",
    [
        (Hyperparameters(step_size=0.1, temperature=0.0), 100),
        (Hyperparameters(step_size=0.1), 0),
        (Hyperparameters(step_size=0.1, adapt_step_size=False, adapt_mass_matrix=False), 100),
    ],
)
def test_nothing_adapts_at_temperature_0_without_warmup_or_flags(hyper, warmup_steps):
    assert new_adaptation(hyper, _theta(3), warmup_steps, 10, False) is None


def test_the_mass_is_dense_for_few_parameters_and_diagonal_when_asked_or_many():
    dense = new_adaptation(Hyperparameters(), _theta(3), 100, 10, False)
    diagonal = new_adaptation(Hyperparameters(dense_mass=False), _theta(3), 100, 10, False)
    network = new_adaptation(Hyperparameters(), _theta(201), 100, 10, False)
    assert type(dense) is DenseAdaptation and dense.unit_scale is None
    assert type(diagonal) is Adaptation and len(diagonal.unit_scale) == 1
    assert type(network) is Adaptation
    # the dense metric keeps no diagonal buffers
    assert dense.scale is None and dense.state()[0].keys().isdisjoint({"scale/0", "means/0"})


def test_a_potential_too_large_to_square_leaves_the_divergence_to_the_kernel():
    # (the trend of the potential squared it and raised OverflowError, met on
    # posteriordb's gp_pois_regr; the kernel's check names a divergence instead)
    adaptation = new_adaptation(Hyperparameters(dense_mass=False), _theta(3), 100, 10, False)
    adaptation.observe_gradient([torch.ones(3, dtype=F64)])
    for step in range(30):
        adaptation.observe_statistic(0.5, 1e200 * (-1) ** step)
    assert math.isfinite(adaptation.step_size)


def test_a_recovery_in_the_langevin_start_buffer_does_not_cap_the_methods_own_steps():
    # The dense start buffer takes Langevin steps; a divergence there halves the step,
    # and the ceiling is Langevin's: SGHMC's steps may grow past it afterwards.
    hyper = SGHMCHyperparameters()
    adaptation = new_adaptation(hyper, _theta(3), 500, 10, False)
    adaptation.start(curvature=1.0)
    start_buffer_end = adaptation._windows[0].end
    grown = []
    for iteration in range(start_buffer_end + 20):  # (within the first slow window)
        if iteration == 10:
            adaptation.recover(adaptation.step_size)  # a divergence at the start step
            ceiling = adaptation.step_size
        adaptation.observe_statistic(-1.0, 100.0)  # far below target: the step grows
        adaptation.end_step(iteration)
        if iteration >= 10:
            grown.append((adaptation.langevin, adaptation.step_size))
    assert all(step <= ceiling for langevin, step in grown if langevin)
    assert grown[-1][1] > 2 * ceiling


def test_the_methods_rules_bound_the_step_size():
    # SGHMC keeps step_size * friction / mass <= 1 in adapted units, SGNHT half that.
    hmc = SGHMCHyperparameters(friction=4.0, mass=2.0)
    nht = SGNHTHyperparameters(friction=4.0, mass=2.0)
    assert hmc.step_exponent == 0.5 and Hyperparameters.step_exponent == 1.0
    assert hmc.max_adapted_step_size() == 0.5 and nht.max_adapted_step_size() == 0.25
    assert hmc.relaxation_rate() == 2.0 and math.isinf(Hyperparameters().relaxation_rate())
    assert Hyperparameters(adapt_mass_matrix=False).max_adapted_step_size() == math.inf


def test_the_diagonal_mass_alone_learns_the_variances_of_a_gaussian():
    # Langevin dynamics (SGLD's update, N = T = 1) on N(0, diag(sd^2)) with variances over
    # three orders of magnitude (within the hundredfold of their geometric mean that the
    # mass may span), the step size fixed: the adaptation's D^{-1} is the variances.
    torch.manual_seed(0)
    sd = torch.tensor([0.2, 0.5, 1.0, 2.0, 5.0], dtype=F64)
    theta = [sd * torch.randn(5, dtype=F64)]  # in the typical set
    hyper = Hyperparameters(step_size=0.1, adapt_step_size=False, dense_mass=False)
    warmup_steps = 400
    adaptation = new_adaptation(hyper, theta, warmup_steps, 1, False)

    def update(theta, grads, step_size):
        (scale,) = adaptation.unit_scale
        noise = math.sqrt(2 * step_size) * torch.randn(5, dtype=F64)
        theta[0] += step_size * scale.square() * grads[0] + scale * noise

    for iteration in range(warmup_steps):
        grads = [-theta[0] / sd.square()]
        adaptation.observe_gradient(grads)
        adaptation.apply(update, theta, grads, adaptation.step_size, adapting=True)
        adaptation.end_step(iteration)
    adaptation.finish()
    (inverse_mass,) = adaptation.inverse_mass_matrix_of({"x": theta[0]}).values()
    ratio = inverse_mass / sd.square()
    assert bool(((ratio > 0.5) & (ratio < 2.0)).all()), ratio
