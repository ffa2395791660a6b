"""Model constructors read ``base`` as ``from_pretrained`` does: a Hub id goes to
transformers unchanged, with the Hub options; a Hub id that cannot be had is a named error.
Nothing here goes online: the root conftest turns the Hub off for every test."""

import pytest
import torch
from huggingface_hub import errors
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pyro_bdl.models import _hub, lora_model

HUB_ID = "meta-llama/Llama-2-7b-hf"


def _record(calls, name, result):
    def from_pretrained(source, **kwargs):
        calls[name] = (source, kwargs)
        return result

    return staticmethod(from_pretrained)


def test_a_hub_id_reaches_from_pretrained_unchanged(
    monkeypatch, tiny_llama, word_tokenizer, tmp_path
):
    model, calls = tiny_llama(), {}
    loaded = (model, {"missing_keys": [], "unexpected_keys": []})
    monkeypatch.setattr(AutoConfig, "from_pretrained", _record(calls, "config", model.config))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _record(calls, "model", loaded))
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", _record(calls, "tokenizer", word_tokenizer)
    )
    hub = {"revision": "a1b2c3", "token": "hf_secret", "cache_dir": str(tmp_path)}

    lora = lora_model(HUB_ID, "causal_lm", torch_dtype=torch.bfloat16, device_map="auto", **hub)

    assert calls["config"] == (HUB_ID, hub)
    assert calls["tokenizer"] == (HUB_ID, hub)
    assert calls["model"] == (
        HUB_ID,
        {**hub, "dtype": torch.bfloat16, "device_map": "auto", "output_loading_info": True},
    )
    assert lora.peft_model.get_base_model() is model
    assert lora.tokenizer is word_tokenizer


def test_an_uncached_hub_id_offline_is_an_error_that_names_it(tmp_path):
    # An empty cache directory: the id cannot be in it.
    with pytest.raises(
        OSError, match=r"lora_model: base='meta-llama/Llama-2-7b-hf' is neither"
    ) as error:
        lora_model(HUB_ID, "causal_lm", cache_dir=str(tmp_path))
    message = str(error.value)
    assert "HF_HUB_OFFLINE=1" in message and f"hf download {HUB_ID}" in message
    assert isinstance(error.value.__cause__, OSError)  # transformers' own error is kept


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"revision": 3}, "revision must be a branch, tag or commit hash"),
        ({"token": 1.5}, "token must be a Hub token"),
    ],
)
def test_bad_hub_options_are_named(kwargs, message):
    with pytest.raises(TypeError, match=message):
        lora_model(HUB_ID, "causal_lm", **kwargs)


def test_dtype_and_torch_dtype_together_are_an_error():
    with pytest.raises(ValueError, match="dtype or torch_dtype"):
        lora_model(HUB_ID, dtype=torch.float16, torch_dtype=torch.float16)


def _raising(cause):
    """A from_pretrained that fails as transformers does: an OSError from the Hub's error."""

    def load(name, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' ...") from cause

    return load


def _hub_error(kind):
    # The Hub's HTTP errors need a response to construct; only their type matters here.
    return kind.__new__(kind)


@pytest.mark.parametrize(
    "cause, kwargs, error, message",
    [
        (_hub_error(errors.GatedRepoError), {}, OSError, "is a gated model.*token="),
        (_hub_error(errors.RepositoryNotFoundError), {}, OSError, "nor a model on the Hugging"),
        (
            _hub_error(errors.RevisionNotFoundError),
            {"revision": "v9"},
            OSError,
            "without the revision 'v9'",
        ),
        (errors.LocalEntryNotFoundError("no"), {}, OSError, "the Hub could not be reached"),
        (
            errors.LocalEntryNotFoundError("no"),
            {"local_files_only": True},
            OSError,
            "downloads are off",
        ),
        (errors.HFValidationError("bad id"), {}, ValueError, "not a Hugging Face Hub id"),
        (PermissionError("denied"), {}, OSError, "couldn't connect"),
    ],
)
def test_each_hub_error_is_named_with_what_to_do(monkeypatch, cause, kwargs, error, message):
    monkeypatch.setattr(_hub, "is_offline_mode", lambda: False)
    with pytest.raises(error, match=f"^load: base='org/model'.*{message}") as raised:
        _hub.from_pretrained(_raising(cause), "org/model", "load: base", **kwargs)
    assert isinstance(raised.value.__cause__, OSError)


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_keeps_the_hubs_download_progress_bars_as_they_were(enabled):
    """transformers' quiet loading (no load report) must not hide a download's progress."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    from pyro_bdl.models.lora import _transformers_quiet

    (enable_progress_bars if enabled else disable_progress_bars)()
    try:
        with _transformers_quiet():
            assert are_progress_bars_disabled() is not enabled
        assert are_progress_bars_disabled() is not enabled
    finally:
        enable_progress_bars()
