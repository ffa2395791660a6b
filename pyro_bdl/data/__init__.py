"""
Data for Bayesian fine-tuning: loaders for the standard formats of the benchmark datasets
(the demo, the examples and the papers' experiments read them), prompt templates, and
collators that make minibatches for Hugging Face models and the CNN-LSTM.

:func:`load` reads one split of a dataset from any directory as a list-like
:class:`RecordDataset` of plain records (dicts with text fields, ``choices`` for multiple
choice, an integer ``label``). A collator turns a list of records into a batch, a dict of
``torch.long`` tensors; :func:`make_loader` draws reproducible minibatches::

    from pyro_bdl.data import ClassificationCollator, load, make_loader

    train = load("sst2", data_dir, "train", limit=4000, seed=0)
    loader = make_loader(train, ClassificationCollator(tokenizer, max_length=128),
                         batch_size=32, shuffle=True, seed=0)

Batch formats (``B`` records, ``L`` tokens: the longest of the batch, ``C`` choices):

- :class:`ClassificationCollator` (SST-2, IMDB; BoolQ as the text pair question, passage):
  ``input_ids``, ``attention_mask`` [, ``token_type_ids``] ``(B, L)``; ``labels`` ``(B,)``.
- :class:`MultipleChoiceCollator` (encoders; one row per :func:`choice_pairs` pair):
  ``input_ids``, ``attention_mask`` [, ``token_type_ids``] ``(B, C, L)``; ``labels`` ``(B,)``.
- :class:`CausalMultipleChoiceCollator` (causal LMs; prompts of :func:`format_prompt`):
  ``input_ids``, ``attention_mask`` ``(B, L)``, LEFT-padded so that position ``-1`` is the
  last prompt token; ``labels`` ``(B,)`` index the record's :func:`answer_labels`, whose
  token ids :func:`answer_token_ids` gives.
- :class:`CausalChoiceTextCollator` (causal LMs scoring each choice's text, cloze):
  ``input_ids``, ``attention_mask``, ``choice_tokens`` ``(B, C, L)``, LEFT-padded;
  ``choice_tokens`` are the choice's token ids at its positions, ``-100`` elsewhere.
- :class:`CausalLMCollator` (windows of :func:`token_windows`): ``input_ids``,
  ``attention_mask``, ``labels`` ``(B, L)``, right-padded; ``labels`` equal ``input_ids``
  (the model shifts them), ``-100`` at padding.
- :class:`WordCollator` (the CNN-LSTM): ``input_ids`` ``(B, 100)`` word indices of a
  :class:`WordVocabulary` (0 padding, 1 unknown; a review's last 100 words, front-padded);
  ``labels`` ``(B,)``.

Every tensor is ``torch.long``.

Tensors already in memory (features and targets, token ids of a whole split) need no
collator: :class:`TensorLoader` takes each batch of every tensor in one indexing
operation, reshuffled every pass from its own seed, sharded across ranks on request::

    from pyro_bdl.data import TensorLoader

    loader = TensorLoader((X, y), batch_size=64, shuffle=True, seed=0)
    mcmc.run(loader, len(X))

A plain ``DataLoader(TensorDataset(X, y), ...)`` passed to an inference routine is made
as fast (:func:`~pyro_bdl.data.tensor_loader.sliced`: the same batches, by index).
"""

from pyro_bdl.data.datasets import DATASETS, load
from pyro_bdl.data.loader import make_loader
from pyro_bdl.data.prompts import answer_labels, choice_pairs, format_prompt
from pyro_bdl.data.readers import read_gutenberg
from pyro_bdl.data.records import RecordDataset
from pyro_bdl.data.tensor_loader import TensorLoader
from pyro_bdl.data.tokenize import (
    CausalChoiceTextCollator,
    CausalLMCollator,
    CausalMultipleChoiceCollator,
    ClassificationCollator,
    MultipleChoiceCollator,
    TokenWindows,
    answer_token_ids,
    token_windows,
)
from pyro_bdl.data.vocabulary import WordCollator, WordVocabulary, split_words

__all__ = [
    "DATASETS",
    "CausalLMCollator",
    "CausalChoiceTextCollator",
    "CausalMultipleChoiceCollator",
    "ClassificationCollator",
    "MultipleChoiceCollator",
    "RecordDataset",
    "TensorLoader",
    "TokenWindows",
    "WordCollator",
    "WordVocabulary",
    "answer_labels",
    "answer_token_ids",
    "choice_pairs",
    "format_prompt",
    "load",
    "make_loader",
    "read_gutenberg",
    "split_words",
    "token_windows",
]
