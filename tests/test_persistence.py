"""bdl.save / bdl.load: a posterior saved here is the same posterior in a new process.

The cases (every Laplace curvature, mean-field VI, IVON and BLoB runs, MCMC and Chains
draws) live in ``persistence_cases.py``: this process fits, saves and computes each
case's outputs; one new Python process loads every directory and computes them again.
Both run the same float64 arithmetic from the same seeds, so they agree to rounding; the
tolerance 1e-6 is the issue's and leaves room for a different BLAS path only.
"""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyro
import pytest
import torch
from safetensors.torch import load_file

import pyro_bdl as bdl
from pyro_bdl.inference import BLoBGuide, BLoBSVI, LaplaceGuide
from pyro_bdl.persistence import (
    CorruptFileError,
    FormatVersionError,
    ManifestError,
    SavedChains,
    SiteMismatchError,
    UnsafeFileError,
)

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "persistence_cases", ROOT / "tests" / "persistence_cases.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case fitted, saved and evaluated here, then loaded in one new process."""
    root = tmp_path_factory.mktemp("posteriors")
    references = {}
    for name, case in cases.CASES.items():
        pyro.clear_param_store()
        model = case.build()
        posterior = case.fit(model)
        bdl.save(posterior, root / name)
        references[name] = {
            k: v.detach().clone() for k, v in case.outputs(model, posterior).items()
        }
    pyro.clear_param_store()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "persistence_cases.py"), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return root, references


@pytest.mark.parametrize("name", list(cases.CASES))
def test_a_new_process_loads_the_same_posterior(saved, name):
    root, references = saved
    loaded = load_file(str(root / name / "loaded.safetensors"))
    reference = references[name]
    assert set(loaded) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=1e-6, msg=key)


def test_draws_are_the_chunked_store_to_arviz_opens(saved):
    root, references = saved
    tree = bdl.to_arviz(root / "chains")
    draws = references["chains"]
    assert tree["posterior"]["hidden.weight"].shape == (2, 4, 6, 5)
    torch.testing.assert_close(
        torch.as_tensor(tree["posterior"]["left.bias"].values), draws["draws/left.bias"]
    )
    assert "lp" in tree["sample_stats"]


def test_a_loaded_run_is_what_to_arviz_and_the_chains_interface_take(saved):
    root, _ = saved
    run = bdl.load(root / "mcmc", cases.mlp_model())
    assert isinstance(run, SavedChains) and run.chain_ids == [0]
    tree = bdl.to_arviz(run)
    assert tree.attrs["method"] == "SGHMC" and tree["posterior"].sizes["draw"] == 6
    with pytest.raises(TypeError, match="cannot run"):
        run.run()


def test_the_guide_state_is_json_and_safetensors_only(saved):
    root, _ = saved
    directory = root / "laplace_kron"
    assert sorted(p.name for p in directory.iterdir()) == [
        "loaded.safetensors",
        "manifest.json",
        "posterior.safetensors",
    ]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["method"] == "LaplaceGuide" and manifest["curvature"] == "kron"
    assert manifest["sites"]["hidden.weight"] == {"shape": [6, 5], "dtype": "float64"}
    # the shapes of the model's arguments, never their values
    assert "tensor" in json.dumps(manifest["example"]) and "0.1" not in json.dumps(
        manifest["example"]
    )
    # the two heads read one hidden layer: their input factor is saved once
    blocks = [b for b in manifest["guide"]["state"]["blocks"] if b["type"] == "kron"]
    heads = {b["site"]: b["input"] for b in blocks}
    assert heads["left.weight"] == heads["right.weight"]


# -- refused directories ---------------------------------------------------------------------


class _Payload:
    """Unpickling this creates a file: proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def laplace_dir(tmp_path):
    model = cases.mlp_model()
    guide = cases.CASES["laplace_diag_ggn"].fit(model)
    return bdl.save(guide, tmp_path / "posterior")


@pytest.mark.parametrize("where", ["beside.pkl", "notes.txt", "posterior.safetensors"])
def test_a_planted_pickle_is_refused_and_never_runs(laplace_dir, tmp_path, where):
    marker = tmp_path / "pwned"
    (laplace_dir / where).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeFileError, match="pickle"):
        bdl.load(laplace_dir, cases.mlp_model())
    assert not marker.exists()


def test_a_model_with_other_sites_is_refused_naming_them(laplace_dir):
    with pytest.raises(SiteMismatchError) as error:
        bdl.load(laplace_dir, cases.mlp_model(hidden=4))
    message = str(error.value)
    assert "'hidden.weight': saved (6, 5), the model (4, 5)" in message
    assert "'left.weight': saved (3, 6), the model (3, 4)" in message
    assert error.value.differences["hidden.bias"] == ((6,), (4,))


def test_a_model_missing_a_site_is_refused(laplace_dir):
    with pytest.raises(
        SiteMismatchError, match="'right.weight': saved \\(3, 6\\), the model absent"
    ):
        bdl.load(laplace_dir, cases.lora_model())


def test_a_truncated_file_is_a_named_error(laplace_dir):
    path = laplace_dir / "posterior.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptFileError, match="truncated"):
        bdl.load(laplace_dir, cases.mlp_model())


def test_a_missing_file_is_a_named_error(laplace_dir):
    (laplace_dir / "posterior.safetensors").unlink()
    with pytest.raises(CorruptFileError, match="missing"):
        bdl.load(laplace_dir, cases.mlp_model())


def test_a_file_changed_inside_is_a_named_error(laplace_dir):
    path = laplace_dir / "posterior.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")  # a header length beyond the file
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="not a readable safetensors file"):
        bdl.load(laplace_dir, cases.mlp_model())


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda m: "{not json", ManifestError, "not valid JSON"),
        (lambda m: json.dumps({**m, "format": "other"}), ManifestError, "not a pyro_bdl"),
        (lambda m: json.dumps({**m, "files": []}), ManifestError, "'files' must be a dict"),
        (lambda m: json.dumps({**m, "format_version": 2}), FormatVersionError, "upgrade"),
    ],
)
def test_a_bad_manifest_is_a_named_error(laplace_dir, edit, error, match):
    path = laplace_dir / "manifest.json"
    path.write_text(edit(json.loads(path.read_text())))
    with pytest.raises(error, match=match):
        bdl.load(laplace_dir, cases.mlp_model())


def test_a_directory_without_manifest_is_refused(tmp_path):
    with pytest.raises(ManifestError, match="has no manifest.json"):
        bdl.load(tmp_path, cases.mlp_model())


def test_saving_refuses_what_it_cannot_keep(tmp_path):
    model = cases.mlp_model()
    with pytest.raises(ValueError, match="has not been fitted"):
        bdl.save(LaplaceGuide(model), tmp_path)
    with pytest.raises(TypeError, match="posterior must be a fitted guide"):
        bdl.save(model, tmp_path)


# -- a peft adapter directory ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["laplace", "blob"])
def test_peft_loads_the_posterior_mean_model(tmp_path, method):
    from peft import PeftModel

    if method == "laplace":
        model = cases.lora_model(b_random=True)
        guide = LaplaceGuide(model, "kron")
        x, y = cases.data()
        guide.fit((x, y), cases.NUM_DATA, num_steps=50, progress=False, mode_tolerance=None)
    else:
        model = cases.lora_model()
        guide = BLoBGuide(model)
        svi = BLoBSVI(model, guide, num_steps=10, lr=1e-2)
        stream = cases.batches()
        for _ in range(4):
            svi.step(*next(stream))
    bdl.save(guide, tmp_path)
    x, _ = cases.data()
    net = _lifted(model)
    with torch.no_grad(), net.fixed(guide.median()):
        expected = net.module(x)
    torch.manual_seed(0)
    base = cases.TinyNet().double()
    with torch.no_grad():
        before = base(x)
        peft_model = PeftModel.from_pretrained(base, str(tmp_path))
        torch.testing.assert_close(peft_model(x), expected, rtol=0, atol=1e-12)
    assert (expected - before).abs().max() > 1e-3  # the fit moved the adapter off B = 0


def _lifted(model):
    """The lifted network a model calls."""
    from pyro_bdl.lift import recording_calls

    x, _ = cases.data()
    with recording_calls() as nets, torch.no_grad():
        pyro.poutine.block(model)((x, None), cases.NUM_DATA)
    return nets[0]


def test_saving_again_replaces_the_earlier_files(tmp_path):
    model = cases.lora_model()
    svi = cases.CASES["blob"].fit(model)
    bdl.save(svi.guide, tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file()
    pyro.clear_param_store()
    bdl.save(cases.CASES["laplace_diag_ggn"].fit(cases.mlp_model()), tmp_path)
    assert not (tmp_path / "adapter_model.safetensors").exists()
    assert isinstance(bdl.load(tmp_path, cases.mlp_model()), LaplaceGuide)


# -- devices and dtypes ----------------------------------------------------------------------


def _float32_twin(model_builder):
    """The same model in float32 (its module cast after building)."""
    model = model_builder()
    from pyro_bdl.lift import recording_calls

    x, _ = cases.data()
    with recording_calls() as nets, torch.no_grad():
        pyro.poutine.block(model)((x, None), cases.NUM_DATA)
    nets[0].module.float()
    return model


def test_a_posterior_loads_in_the_dtype_of_the_model(laplace_dir):
    x, y = cases.data()
    reference = bdl.load(laplace_dir, cases.mlp_model()).predictive((x, None), cases.NUM_DATA)
    model = _float32_twin(cases.mlp_model)
    guide = bdl.load(laplace_dir, model, dtype=torch.float32)
    assert all(value.dtype == torch.float32 for value in guide.median().values())
    probs = guide.predictive((x.float(), None), cases.NUM_DATA)
    # float32 rounding of a float64 posterior (relative 6e-8 per number) through two
    # layers and the MC link's draws: far below 1e-5
    torch.testing.assert_close(probs, reference.float(), rtol=0, atol=1e-5)
    # with one batch of float32 arguments the model's dtype is found without being told
    found = bdl.load(laplace_dir, model, model_args=((x.float(), y), cases.NUM_DATA))
    assert all(value.dtype == torch.float32 for value in found.median().values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_saved_on_cuda_loads_on_the_cpu_and_back(tmp_path):
    x, y = cases.data()
    model = cases.mlp_model()
    net = _lifted(model)
    net.module.cuda()
    batch = ((x.cuda(), y.cuda()), cases.NUM_DATA)
    guide = LaplaceGuide(model, "kron").fit(
        *batch, num_steps=50, progress=False, mode_tolerance=None
    )
    generator = torch.Generator(device="cuda").manual_seed(0)
    reference = guide.predictive((x.cuda(), None), cases.NUM_DATA, generator=generator).cpu()
    bdl.save(guide, tmp_path)
    on_cpu = bdl.load(tmp_path, cases.mlp_model())  # the model on the CPU: the guide too
    assert all(value.device.type == "cpu" for value in on_cpu.median().values())
    probs = on_cpu.predictive((x, None), cases.NUM_DATA, link="probit")
    expected = guide.predictive((x.cuda(), None), cases.NUM_DATA, link="probit").cpu()
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-8)
    back = bdl.load(tmp_path, model, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    again = back.predictive((x.cuda(), None), cases.NUM_DATA, generator=generator).cpu()
    torch.testing.assert_close(again, reference)


def test_a_loaded_guide_exports_to_arviz(saved):
    root, references = saved
    guide = bdl.load(root / "laplace_kron", cases.mlp_model())
    x, y = cases.data()
    tree = bdl.to_arviz(guide, num_samples=3, model_args=((x, y), cases.NUM_DATA))
    assert tree["posterior"]["hidden.weight"].shape == (1, 3, 6, 5)
    assert tree.attrs["method"] == "LaplaceGuide" and tree.attrs["link"] == guide.link
    assert "hidden.weight.kron_input_eigenvectors" in tree["approximation"]
