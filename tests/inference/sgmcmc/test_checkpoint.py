"""Checkpoints of SGMCMC chains: resume in worker processes and in the same process, the
safetensors state, and refusal of anything that would run code on load."""

import json
import pickle

import numpy
import pyro
import pyro.infer.mcmc.api
import pytest
import torch
from pyro.infer import MCMC
from safetensors import safe_open

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD, SGNHT
from pyro_bdl.inference.sgmcmc.checkpoint import read_state

from .test_kernel import NUM_DATA, _data, _loader, _regression


class _Payload:
    """A pickle that, once unpickled, writes a marker file: what a planted state could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_with_chains_in_worker_processes_finishes_and_resumes(monkeypatch, tmp_path):
    # Issue 10 item 5: with a spare core per chain Pyro runs the chains in worker processes
    # and then sets the kernel up once more in the main process; that set-up used to open
    # chain_0 with warmup_steps=0 and fail on its settings after every draw was written.
    monkeypatch.setattr(pyro.infer.mcmc.api.mp, "cpu_count", lambda: 4)
    _, model = _regression()

    def run():
        kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path)
        mcmc = MCMC(
            kernel,
            num_samples=4,
            warmup_steps=10,
            num_chains=2,
            mp_context="fork",
            disable_progbar=True,
        )
        mcmc.run(_data(), NUM_DATA)
        return mcmc.get_samples(group_by_chain=True)["weight"]

    first = run()
    assert first.shape == (2, 4, 1, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain_0", "chain_1"]
    for chain in range(2):
        _, state = read_state(tmp_path / f"chain_{chain}" / "state.safetensors")
        assert (state["iteration"], state["num_draws"]) == (14, 4)
    assert torch.equal(run(), first)  # replayed from the stores, nothing recomputed


def test_rerun_of_the_same_mcmc_after_an_interrupt_resumes_chain_0(tmp_path):
    # Issue 10 item 6: calling mcmc.run again on the same MCMC and kernel after Ctrl-C
    # used to start chain_1 from scratch.
    _, model = _regression()
    kernel = SGHMC(model, step_size=1e-3, checkpoint=tmp_path, checkpoint_every=1)
    mcmc = MCMC(kernel, num_samples=6, warmup_steps=2, disable_progbar=True)
    interrupted = []

    def interrupt(kernel, params, stage, i):
        if stage == "Sample" and i == 2 and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    mcmc.sampler.hook = interrupt
    with pytest.raises(KeyboardInterrupt):
        mcmc.run(_loader(), NUM_DATA)
    kept = kernel.get_draws()["weight"].clone()
    assert len(kept) == 3
    mcmc.run(_loader(), NUM_DATA)
    assert [p.name for p in tmp_path.iterdir()] == ["chain_0"]
    samples = mcmc.get_samples()["weight"]
    assert samples.shape == (6, 1, 3)
    assert torch.equal(samples[:3], kept)
    assert kernel.state.step == 2 + 6  # the three kept draws were not recomputed
    assert len(kernel.diagnostics()["sample_stats"]["potential_energy"]) == 6


@pytest.mark.parametrize("kernel_class", [SGLD, SGHMC, SGNHT])
def test_resumed_chain_continues_exactly_where_the_state_was_saved(tmp_path, kernel_class):
    # A full-batch chain is deterministic given its RNG: resuming from a state saved half
    # way reproduces the uninterrupted chain bit for bit (parameters, momenta, thermostat
    # and the noise generator all come back).
    _, model = _regression()
    x, y = _data()

    def run(directory, num_samples):
        pyro.set_rng_seed(1)
        kernel = kernel_class(model, step_size=1e-3, checkpoint=directory, checkpoint_every=1)
        mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=3, disable_progbar=True)
        mcmc.run((x, y), NUM_DATA)
        return mcmc.get_samples()["weight"], kernel

    straight, _ = run(tmp_path / "straight", 8)
    run(tmp_path / "halves", 4)
    resumed, kernel = run(tmp_path / "halves", 8)
    assert kernel.state.step == 3 + 8
    assert torch.equal(resumed, straight)


def test_state_is_safetensors_with_json_settings_and_rng(tmp_path):
    _, model = _regression()
    kernel = SGHMC(model, step_size=1e-3, checkpoint=tmp_path)
    MCMC(kernel, num_samples=3, warmup_steps=1, disable_progbar=True).run(_loader(), NUM_DATA)
    path = tmp_path / "chain_0" / "state.safetensors"
    with safe_open(path, framework="pt") as handle:
        keys = set(handle.keys())
        state = json.loads(handle.metadata()["state"])
    stiff = {"direction/0", "next/0", "block/0", "slope/0", "sums"}
    adapted = {f"adaptation/stiff/{name}" for name in stiff}
    # four parameters: a dense mass (dense.py), its factor and its window's sums, and
    # none of the diagonal mass's buffers
    dense = ("factor", "theta", "theta2", "grad", "cross", "halves")
    adapted |= {f"adaptation/dense/{name}" for name in dense}
    # and the sums under the final metric that measure the gradient noise
    fixed = ("theta", "theta2", "grad", "cross", "heat")
    adapted |= {f"adaptation/dense/fixed/{name}" for name in fixed}
    assert keys == {
        "theta/weight",
        "theta/bias",
        "aux/momenta/0",
        "aux/momenta/1",
        "rng/cpu",
        *adapted,
    }
    assert state["settings"]["method"] == "SGHMC" and state["num_draws"] == 3
    assert state["settings"]["adapt_step_size"] and state["settings"]["adapt_mass_matrix"]
    assert state["adaptation"]["step_size"] == kernel.adapted_step_size
    assert state["iteration"] == 4 and state["step"] == 4
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.tmp"))


def test_a_planted_pickle_is_refused_and_never_run(tmp_path):
    _, model = _regression()
    marker = tmp_path / "pwned"
    chain = tmp_path / "run" / "chain_0"
    chain.mkdir(parents=True)
    (chain / "state.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path / "run")
    with pytest.raises(ValueError, match="is not a safetensors file.*never unpickled"):
        MCMC(kernel, num_samples=2, disable_progbar=True).run(_loader(), NUM_DATA)
    assert not marker.exists()

    # the pickled state.pt of earlier versions is refused by name, not loaded
    (chain / "state.safetensors").unlink()
    torch.save({"payload": _Payload(marker)}, chain / "state.pt")
    kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path / "run")
    with pytest.raises(ValueError, match="state.pt is a pickled state.*arbitrary code"):
        MCMC(kernel, num_samples=2, disable_progbar=True).run(_loader(), NUM_DATA)
    assert not marker.exists()


def test_a_planted_zarr_v2_pickle_store_is_refused(tmp_path):
    numcodecs = pytest.importorskip("numcodecs")
    marker = tmp_path / "pwned"
    store = tmp_path / "chain_0" / "draws.zarr"
    array = store / "posterior" / "w"
    array.mkdir(parents=True)
    # zarr format 2 metadata may declare an object array decoded by pickle (zarr 2 ran it)
    (store / ".zgroup").write_text(json.dumps({"zarr_format": 2}))
    metadata = {
        "zarr_format": 2,
        "shape": [1],
        "chunks": [1],
        "dtype": "|O",
        "compressor": None,
        "fill_value": None,
        "filters": [{"id": "pickle", "protocol": 5}],
        "order": "C",
    }
    (array / ".zarray").write_text(json.dumps(metadata))
    payload = numpy.empty(1, dtype=object)
    payload[0] = _Payload(marker)
    (array / "0").write_bytes(numcodecs.Pickle().encode(payload))
    with pytest.raises(ValueError, match="not a zarr format 3 store.*pickle"):
        bdl.to_arviz(tmp_path)
    assert not marker.exists()


def test_a_different_run_in_the_same_directory_is_refused(tmp_path):
    _, model = _regression()
    MCMC(SGLD(model, step_size=1e-3, checkpoint=tmp_path), num_samples=2).run(_loader(), NUM_DATA)
    with pytest.raises(ValueError, match="checkpoint: .* holds a chain with settings"):
        MCMC(SGLD(model, step_size=2e-3, checkpoint=tmp_path), num_samples=2).run(
            _loader(), NUM_DATA
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chain_saves_and_restores_its_device_rng(tmp_path):
    x, y = (t.cuda() for t in _data())
    net = bdl.lift(torch.nn.Linear(3, 1).double().cuda(), bdl.priors.IIDNormal(1.0))

    def model(x, y):
        bdl.observe("y", pyro.distributions.Normal(net(x).squeeze(-1), 0.5), y, NUM_DATA)

    def run(directory, num_samples):
        pyro.set_rng_seed(1)
        kernel = SGLD(model, step_size=1e-3, checkpoint=directory, checkpoint_every=1)
        mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=2, disable_progbar=True)
        mcmc.run(x, y)
        return mcmc.get_samples()["weight"]

    straight = run(tmp_path / "straight", 6)
    run(tmp_path / "halves", 3)
    with safe_open(tmp_path / "halves" / "chain_0" / "state.safetensors", framework="pt") as h:
        assert "rng/cuda" in set(h.keys())
    resumed = run(tmp_path / "halves", 6)
    assert resumed.is_cuda and torch.equal(resumed, straight)
