"""SGNHT with its default warm-up adaptation from a far start gives the posterior
without an equilibrium warning (``tests/inference/sgmcmc/test_equilibrium.py`` runs the
same check on the fixed kernel; its docstring gives the problem and the tolerances)."""

import time

from tests.inference.sgmcmc.test_equilibrium import assert_far_start_gives_the_posterior


def test_adapted_sgnht_from_a_far_start_gives_the_posterior_without_warning(report):
    started = time.perf_counter()
    assert_far_start_gives_the_posterior({})
    report("sgmcmc_equilibrium", kernel="SGNHT adapted", seconds=time.perf_counter() - started)
