"""Every guide's state_dict() carries its whole approximation, as tensors (GuideState).

A guide inside any torch checkpoint (``torch.save`` of a state dict, Lightning,
accelerate, Hugging Face's Trainer) round-trips: the state dict holds only tensors,
loads with ``torch.load(..., weights_only=True)`` and gives a guide that predicts the
same, to the last bit (the same float64 arithmetic from the same seeds).
"""

import importlib.util
import io
from pathlib import Path

import pyro
import pytest
import torch
from safetensors.torch import load, save

from pyro_bdl.inference import BLoBGuide, IVONGuide, LaplaceGuide, MeanFieldGuide
from pyro_bdl.inference.guide_state import SiteMismatchError

_path = Path(__file__).resolve().parents[1] / "persistence_cases.py"
_spec = importlib.util.spec_from_file_location("persistence_cases", _path)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

# guide -> the persistence case that fits it, and how to build an empty twin
GUIDES = {
    "laplace": ("laplace_kron", lambda model: LaplaceGuide(model, "kron")),
    "mean_field": ("mean_field", MeanFieldGuide),
    "ivon": ("ivon", IVONGuide),
    "blob": ("blob", BLoBGuide),
}


def _fitted(kind):
    case = cases.CASES[GUIDES[kind][0]]
    model = case.build()
    fitted = case.fit(model)
    return model, getattr(fitted, "guide", fitted)


def _twin(kind, model):
    """A new guide of the kind on the model, set up as after its first call."""
    guide = GUIDES[kind][1](model)
    if kind != "laplace":
        guide(*next(cases.batches()))
    return guide


def _through_torch_save(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind", list(GUIDES))
def test_state_dict_round_trips_through_a_torch_checkpoint(kind):
    model, guide = _fitted(kind)
    state = guide.state_dict()
    assert all(torch.is_tensor(value) for value in state.values())
    save({k: v.contiguous() for k, v in state.items()})  # safetensors takes it as it is
    reference = cases.predictions(model, guide)
    pyro.clear_param_store()  # a new process has none of the old guide's parameters
    twin = _twin(kind, model)
    twin.load_state_dict(_through_torch_save(state))
    torch.testing.assert_close(cases.predictions(model, twin), reference, rtol=0, atol=0)


def test_a_guide_inside_another_module_round_trips():
    model, guide = _fitted("ivon")
    holder = torch.nn.ModuleDict({"posterior": guide})
    state = holder.state_dict()
    assert "posterior._bdl/weight_decay" in state and "posterior.loc_unconstrained" in state
    reference = cases.predictions(model, guide)
    pyro.clear_param_store()
    twin = torch.nn.ModuleDict({"posterior": _twin("ivon", model)})
    twin.load_state_dict(load(save({k: v.contiguous() for k, v in state.items()})))
    torch.testing.assert_close(cases.predictions(model, twin["posterior"]), reference)


def test_a_laplace_state_loads_into_an_unfitted_guide():
    model, guide = _fitted("laplace")
    twin = LaplaceGuide(model, "kron")
    twin.load_state_dict(guide.state_dict())
    x, _ = cases.data()
    generator = torch.Generator().manual_seed(0)
    expected = guide.predictive((x, None), cases.NUM_DATA, generator=generator)
    generator = torch.Generator().manual_seed(0)
    torch.testing.assert_close(
        twin.predictive((x, None), cases.NUM_DATA, generator=generator), expected
    )
    assert twin.prior_precision.keys() == guide.prior_precision.keys()


def test_a_vi_state_needs_a_guide_that_has_seen_its_model():
    model, guide = _fitted("mean_field")
    with pytest.raises(RuntimeError, match="call it once with the model's arguments"):
        MeanFieldGuide(model).load_state_dict(guide.state_dict())


def test_a_state_loads_only_into_a_guide_of_its_class_and_settings():
    model, guide = _fitted("mean_field")
    state = guide.state_dict()
    with pytest.raises(ValueError, match="is a MeanFieldGuide's; load it into a MeanFieldGuide"):
        _twin("ivon", model).load_state_dict(state)
    other = MeanFieldGuide(model, temperature=0.5)
    other(*next(cases.batches()))
    with pytest.raises(ValueError, match=r"'temperature': \(1.0, 0.5\)"):
        other.load_state_dict(state)


def test_a_state_of_other_sites_is_refused():
    _, guide = _fitted("mean_field")
    state = guide.state_dict()
    pyro.clear_param_store()
    smaller = cases.mlp_model(hidden=4)
    with pytest.raises(SiteMismatchError, match="'hidden.weight': saved \\(6, 5\\)"):
        _twin("mean_field", smaller).load_state_dict(state)
