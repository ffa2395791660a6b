"""bdl.save / bdl.load: a posterior saved here is the same posterior in a new process.

The cases (every Laplace curvature, mean-field VI, IVON and BLoB runs, MCMC and Chains
draws) live in ``persistence_cases.py``: this process fits, saves and computes each
case's outputs; one new Python process loads every directory and computes them again.
Both run the same float64 arithmetic from the same seeds, so they agree to rounding; the
tolerance 1e-6 is the issue's and leaves room for a different BLAS path only.
"""

import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from safetensors.torch import load_file

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, BLoBGuide, BLoBSVI, LaplaceGuide
from pyro_bdl.persistence import (
    FORMAT_VERSION,
    CorruptFileError,
    FormatVersionError,
    ManifestError,
    SavedChains,
    SiteMismatchError,
    SupportMismatchError,
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
    assert manifest["sites"]["hidden.weight"] == {
        "shape": [6, 5],
        "dtype": "float64",
        "support": {
            "name": "IndependentConstraint",
            "base_constraint": {"name": "Real"},
            "reinterpreted_batch_ndims": 2,
        },
        "prior": "Normal",
    }
    sha256 = hashlib.sha256((directory / "posterior.safetensors").read_bytes()).hexdigest()
    assert manifest["files"]["posterior.safetensors"]["sha256"] == sha256
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
    with pytest.raises(CorruptFileError, match="changed after bdl.save wrote it"):
        bdl.load(laplace_dir, cases.mlp_model())
    _as_version_1(laplace_dir)  # no hash to compare: the reader refuses it
    with pytest.warns(UserWarning, match="not verified"):
        with pytest.raises(CorruptFileError, match="not a readable safetensors file"):
            bdl.load(laplace_dir, cases.mlp_model())


def _flip_32_bytes(path: Path) -> None:
    """32 bytes inside the tensors of a safetensors file flipped: the same size, a valid
    header, numbers that are not the saved ones."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    step = (len(data) - start) // 32
    for i in range(32):
        data[start + 7 + step * i] ^= 0x7F  # the high byte of a float64: its exponent
    path.write_bytes(bytes(data))


def test_32_flipped_bytes_of_the_same_size_are_refused(laplace_dir):
    """Issue 35: before, this loaded (a median weight of 3.8e22); now its SHA-256 differs."""
    _flip_32_bytes(laplace_dir / "posterior.safetensors")
    with pytest.raises(CorruptFileError, match="SHA-256 is .* the manifest's"):
        bdl.load(laplace_dir, cases.mlp_model())


def regression(prior):
    """The issue's regression: w ~ Normal, sigma ~ prior, y in a data plate."""

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([5]).to_event(1))
        sigma = pyro.sample("sigma", prior)
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(x @ w, sigma), obs=y)

    return model


def test_a_model_with_another_prior_on_a_site_is_refused(tmp_path, float64):
    """Issue 35: the same site names and shapes, sigma ~ Uniform(0, 10) where HalfNormal was
    fitted. Before, it loaded and sigma's median moved from 0.70 to 4.1; now refused."""
    x, _ = cases.data()
    y = x @ torch.linspace(-1, 1, 5) + 0.7 * torch.randn(len(x), generator=cases.seeded(0))
    guide = LaplaceGuide(regression(dist.HalfNormal(1.0)), "full")
    guide.fit(x, y, progress=False)
    bdl.save(guide, tmp_path)
    with pytest.raises(SupportMismatchError) as error:
        bdl.load(tmp_path, regression(dist.Uniform(0.0, 10.0)))
    message = str(error.value)
    assert "'sigma': saved support GreaterThanEq(lower_bound=0.0), prior HalfNormal" in message
    assert "the model support Interval(lower_bound=0.0, upper_bound=10.0), prior Uniform" in message
    assert isinstance(error.value, SiteMismatchError)
    with pytest.raises(SupportMismatchError, match="prior Exponential"):  # same support
        bdl.load(tmp_path, regression(dist.Exponential(1.0)))
    loaded = bdl.load(tmp_path, regression(dist.HalfNormal(1.0)))
    torch.testing.assert_close(loaded.median(), guide.median(), rtol=0, atol=0)


def _as_version_1(directory: Path) -> None:
    """The manifest as pyro_bdl wrote it before issue 35: no hashes, no supports, no priors."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 1
    for entry in manifest["files"].values():
        entry.pop("sha256", None)
        entry.pop("files", None)
    for entry in manifest["sites"].values():
        entry.pop("support", None)
        entry.pop("prior", None)
    path.write_text(json.dumps(manifest))


def test_an_older_manifest_without_hashes_loads_with_a_warning(laplace_dir):
    reference = bdl.load(laplace_dir, cases.mlp_model()).median()
    _as_version_1(laplace_dir)
    with pytest.warns(UserWarning, match="format version 1 .* not verified"):
        loaded = bdl.load(laplace_dir, cases.mlp_model())
    torch.testing.assert_close(loaded.median(), reference, rtol=0, atol=0)


def test_a_manifest_of_version_2_without_its_hashes_is_refused(laplace_dir):
    """No switch skips the check: a hash struck from a version 2 manifest is refused."""
    path = laplace_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["files"]["posterior.safetensors"]["sha256"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="without its SHA-256"):
        bdl.load(laplace_dir, cases.mlp_model())


def test_draws_verify_every_file_of_their_stores(saved, tmp_path):
    """A chunk of a draw store changed, or a file planted in one, is refused."""
    root, _ = saved
    manifest = json.loads((root / "chains" / "manifest.json").read_text())
    assert manifest["sites"]["hidden.bias"]["prior"] == "Normal"  # the kernel's model's
    for change in ("flip", "plant"):
        directory = tmp_path / change
        shutil.copytree(root / "chains", directory)
        store = directory / "chain_0" / "draws.zarr"
        chunk = max((p for p in store.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        if change == "flip":
            data = bytearray(chunk.read_bytes())
            data[len(data) // 2] ^= 0xFF
            chunk.write_bytes(bytes(data))
            match = "changed after bdl.save wrote it"
        else:
            (chunk.parent / "planted").write_bytes(b"\x00" * 8)
            match = "holds files bdl.save did not write"
        with pytest.raises(CorruptFileError, match=match):
            bdl.load(directory, cases.mlp_model())


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda m: "{not json", ManifestError, "not valid JSON"),
        (lambda m: json.dumps({**m, "format": "other"}), ManifestError, "not a pyro_bdl"),
        (lambda m: json.dumps({**m, "files": []}), ManifestError, "'files' must be a dict"),
        (
            lambda m: json.dumps({**m, "format_version": FORMAT_VERSION + 1}),
            FormatVersionError,
            "upgrade",
        ),
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


def test_a_kernels_checkpoint_directory_loads_as_saved_draws(tmp_path):
    """Draws have one layout on disk: bdl.load reads a checkpoint directory as it reads
    what bdl.save wrote (warning that no manifest verifies it)."""
    x, y = cases.data()
    model = cases.mlp_model()
    kernel = SGHMC(model, step_size=1e-3, checkpoint=tmp_path)
    mcmc = MCMC(kernel, num_samples=5, warmup_steps=3, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # five draws are far from converged, on purpose
        mcmc.run((x, y), cases.NUM_DATA)
    with pytest.warns(UserWarning, match="checkpoint directory.*not verified"):
        run = bdl.load(tmp_path, cases.mlp_model())
    assert isinstance(run, SavedChains) and run.warmup_steps == 3 and run.num_samples == 5
    for name, value in mcmc.get_samples(group_by_chain=True).items():
        torch.testing.assert_close(run.get_samples(group_by_chain=True)[name], value)
    assert run.kernel.hyperparameters()["method"] == "SGHMC"
