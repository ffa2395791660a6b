"""Loading pretrained files as ``from_pretrained`` does, with errors that name the argument.

A model constructor's ``base`` is a local directory or a Hugging Face Hub id, exactly as
``from_pretrained`` takes it: transformers reads the directory, or the Hub cache, and
downloads what the cache lacks unless ``HF_HUB_OFFLINE=1`` (or ``local_files_only=True``)
says otherwise. transformers reports every failure as an ``OSError`` about URLs; the
constructor's user needs to hear which argument was wrong and what to do, so the Hub's
error (kept as ``__cause__``) is re-raised with that.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from huggingface_hub import errors, is_offline_mode

__all__ = ["HUB_OPTIONS", "hub_options", "from_pretrained"]

T = TypeVar("T")

# The from_pretrained arguments that say where the files come from: the configuration, the
# weights and the tokenizer of one model must all come from the same place.
HUB_OPTIONS = (
    "revision",
    "token",
    "cache_dir",
    "local_files_only",
    "force_download",
    "proxies",
    "trust_remote_code",
)


def hub_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that say where files come from (None values dropped)."""
    return {key: kwargs[key] for key in HUB_OPTIONS if kwargs.get(key) is not None}


def from_pretrained(
    load: Callable[..., T], name: str | os.PathLike, where: str, **kwargs: Any
) -> T:
    """``load(name, **kwargs)`` (a ``from_pretrained``), its Hub errors re-raised by name.

    :param load: e.g. ``AutoConfig.from_pretrained``.
    :param name: a local directory or a Hub id.
    :param str where: the caller and its argument, e.g. ``"lora_model: base"``.
    """
    try:
        return load(name, **kwargs)
    except OSError as error:  # transformers wraps the Hub's errors in an OSError
        raise _named(error, where, str(name), kwargs) from error


# What to tell the user for each Hub error; the first that matches (a GatedRepoError is a
# RepositoryNotFoundError too).
_ADVICE = (
    (
        errors.GatedRepoError,
        "is a gated model on the Hugging Face Hub; accept its licence on huggingface.co, "
        "then pass token=... (or log in with `hf auth login`)",
    ),
    (
        errors.RepositoryNotFoundError,
        "is neither a local directory nor a model on the Hugging Face Hub (a private one "
        "needs token=...); check the id or pass a local directory",
    ),
    (
        errors.RevisionNotFoundError,
        "names a Hub model without the revision {revision!r}; pass one of its branches, tags "
        "or commit hashes as revision=...",
    ),
)
_HUB_ERRORS = (
    errors.HFValidationError,
    errors.LocalEntryNotFoundError,
    *(kind for kind, _ in _ADVICE),
)


def _hub_cause(error: BaseException) -> BaseException | None:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, _HUB_ERRORS):
            return error
        error = error.__cause__ or error.__context__
    return None


def _named(error: OSError, where: str, name: str, kwargs: dict[str, Any]) -> Exception:
    cause = _hub_cause(error)
    subject = f"{where}={name!r}"
    if isinstance(cause, errors.HFValidationError):
        return ValueError(
            f"{subject} is not a directory and not a Hugging Face Hub id ('owner/name'); pass "
            "a local model directory or a Hub id such as 'meta-llama/Llama-2-7b-hf'"
        )
    if isinstance(cause, errors.LocalEntryNotFoundError):
        if is_offline_mode() or kwargs.get("local_files_only"):
            why = (
                "downloads are off (HF_HUB_OFFLINE=1 or local_files_only=True); download it "
                f"once online (`hf download {name}`, or run without HF_HUB_OFFLINE) or pass "
                "the directory of a saved model"
            )
        else:
            why = (
                "the Hub could not be reached; check the connection (or a proxy), or pass a "
                "local directory"
            )
        return OSError(
            f"{subject} is neither a local directory nor in the Hugging Face cache, and {why}"
        )
    for kind, advice in _ADVICE:
        if isinstance(cause, kind):
            return OSError(f"{subject} {advice.format(revision=kwargs.get('revision'))}")
    return OSError(f"{subject}: {error}")
