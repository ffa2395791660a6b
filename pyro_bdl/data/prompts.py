"""
Prompt templates of Laplace-LoRA and BLoB for multiple choice with causal language models,
and (context, choice) text pairs for multiple choice with encoders.

A causal LM answers by the logits, at the last prompt position, of one label token per
choice (:func:`answer_labels`); the templates are Table 6 of BLoB (Wang et al., 2024),
Table 3 of Laplace-LoRA (Yang et al., 2024):

- WinoGrande: ``Select one of the choices that answers the following question:
  {sentence} Choices: A. {option1}. B. {option2}. Answer:``
- ARC, OpenBookQA: ``Select one of the choices that answers the following question:
  {question} Choices: A. {choice1}. B. {choice2}. C. {choice3}. D. {choice4}. Answer:``
- BoolQ: ``Answer the question with only True or False: {question} Context: {passage}.``

A text that already ends in a full stop gets none added, as in the papers' code.
"""

from __future__ import annotations

from pyro_bdl.data.records import Record

_QUESTION_FIELD = {
    "winogrande_xs": "sentence",
    "winogrande_s": "sentence",
    "winogrande_m": "sentence",
    "arc_easy": "question",
    "arc_challenge": "question",
    "obqa": "question",
}
#: The datasets with (context, choice) pairs for encoders.
MULTIPLE_CHOICE: tuple[str, ...] = tuple(_QUESTION_FIELD)
#: The datasets with a causal-LM prompt template.
PROMPTED: tuple[str, ...] = (*_QUESTION_FIELD, "boolq")
_PROMPTED = PROMPTED
_SELECT = "Select one of the choices that answers the following question: "
_TRUE_FALSE = "Answer the question with only True or False: "


def _check_prompted(dataset_name: str) -> None:
    if dataset_name not in _PROMPTED:
        raise ValueError(
            f"no prompt template for {dataset_name!r}; templates exist for {', '.join(_PROMPTED)}"
        )


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


def _letters(record: Record) -> list[str]:
    return [chr(ord("A") + i) for i in range(len(record["choices"]))]


def format_prompt(record: Record, dataset_name: str) -> str:
    """
    The causal-LM prompt for one record; the model answers with its next token.

    Example::

        >>> record = {"sentence": "Sarah beat Maria so _ won.", "choices": ["Sarah", "Maria"]}
        >>> format_prompt(record, "winogrande_s").split(": ", 1)[1]
        'Sarah beat Maria so _ won. Choices: A. Sarah. B. Maria. Answer:'

    :param dict record: a record of :func:`pyro_bdl.data.load` for ``dataset_name``.
    :param str dataset_name: ``winogrande_*``, ``arc_easy``, ``arc_challenge``, ``obqa`` or
        ``boolq``.
    """
    _check_prompted(dataset_name)
    if dataset_name == "boolq":
        return f"{_TRUE_FALSE}{record['question']} Context: {_sentence(record['passage'])}"
    question = "{" + _QUESTION_FIELD[dataset_name] + "}"
    return fill_template(f"{_SELECT}{question} Choices: {{choices}} Answer:", record)


def fill_template(template: str, record: Record) -> str:
    """
    A prompt of one's own: ``template`` formatted with the record's fields, ``{choices}``
    being the lettered choices as the papers' templates write them.

    Example::

        >>> record = {"sentence": "Sarah beat Maria so _ won.", "choices": ["Sarah", "Maria"]}
        >>> fill_template("{sentence}\\n{choices}\\nAnswer:", record)
        'Sarah beat Maria so _ won.\\nA. Sarah. B. Maria.\\nAnswer:'

    :param str template: a ``str.format`` template over the record's fields.
    :param dict record: a record of :func:`pyro_bdl.data.load`.
    :raises ValueError: when the template names a field the record lacks.
    """
    fields = dict(record)
    if "choices" in record:
        fields["choices"] = " ".join(
            f"{letter}. {_sentence(choice)}"
            for letter, choice in zip(_letters(record), record["choices"], strict=True)
        )
    try:
        return template.format(**fields)
    except KeyError as error:
        raise ValueError(
            f"template names the field {error.args[0]!r}, which the record lacks (fields: "
            f"{', '.join(fields)}); name one of those, or {{choices}} for the lettered choices"
        ) from None


def answer_labels(record: Record, dataset_name: str) -> list[str]:
    """
    The label texts whose next-token logits score the choices; ``record["label"]``
    indexes this list.

    Multiple choice gives ``[" A", " B", ...]``, one per choice. BoolQ gives
    ``[" False", " True"]``: False first, so that label 1 (True) picks ``" True"``.
    The leading space is how the label follows ``"Answer:"`` in running text.

    Example::

        >>> answer_labels({"question": "q", "passage": "p", "label": 1}, "boolq")
        [' False', ' True']

    :param dict record: a record of :func:`pyro_bdl.data.load` for ``dataset_name``.
    :param str dataset_name: as for :func:`format_prompt`.
    """
    _check_prompted(dataset_name)
    if dataset_name == "boolq":
        return [" False", " True"]
    return [f" {letter}" for letter in _letters(record)]


def choice_pairs(record: Record, dataset_name: str) -> list[tuple[str, str]]:
    """
    One (context, choice) text pair per choice, for an encoder that scores each pair.

    For WinoGrande the context is the sentence up to the blank and the choice is the
    option followed by the rest of the sentence (the blank filled in), as in the
    WinoGrande baselines; for ARC and OpenBookQA it is (question, choice text).

    Example::

        >>> record = {"sentence": "Sarah beat Maria so _ won.", "choices": ["Sarah", "Maria"]}
        >>> choice_pairs(record, "winogrande_xs")
        [('Sarah beat Maria so', 'Sarah won.'), ('Sarah beat Maria so', 'Maria won.')]

    :param dict record: a multiple-choice record of :func:`pyro_bdl.data.load`.
    :param str dataset_name: ``winogrande_*``, ``arc_easy``, ``arc_challenge`` or ``obqa``.
    """
    if dataset_name not in _QUESTION_FIELD:
        raise ValueError(
            f"choice_pairs needs a multiple-choice dataset ({', '.join(_QUESTION_FIELD)}), "
            f"got {dataset_name!r}"
        )
    if _QUESTION_FIELD[dataset_name] == "sentence":
        before, _, after = record["sentence"].partition("_")
        return [(before.strip(), f"{choice}{after}") for choice in record["choices"]]
    return [(record["question"], choice) for choice in record["choices"]]
