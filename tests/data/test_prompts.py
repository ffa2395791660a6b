import pytest

from pyro_bdl.data import answer_labels, choice_pairs, format_prompt, load

SELECT = "Select one of the choices that answers the following question: "


def test_winogrande_prompt(data_root):
    record = load("winogrande_s", data_root, "test")[0]
    assert format_prompt(record, "winogrande_s") == (
        SELECT + "Sarah was a much better surgeon than Maria so _ always got the easier cases. "
        "Choices: A. Sarah. B. Maria. Answer:"
    )
    assert answer_labels(record, "winogrande_s") == [" A", " B"]


def test_arc_prompt(data_root):
    record = load("arc_easy", data_root, "train")[0]
    assert format_prompt(record, "arc_easy") == (
        SELECT + "Which factor will most likely cause a person to develop a fever? Choices: "
        "A. a leg muscle relaxing after exercise. B. a bacterial population in the bloodstream. "
        "C. several viral particles on the skin. D. carbohydrates being digested in the "
        "stomach. Answer:"
    )
    assert answer_labels(record, "arc_easy") == [" A", " B", " C", " D"]


def test_choices_ending_in_a_full_stop_get_no_second_one(data_root):
    record = load("arc_challenge", data_root, "test")[0]
    assert format_prompt(record, "arc_challenge") == (
        SELECT + "An astronomer observes that a planet rotates faster after a meteorite impact. "
        "Which is the most likely effect of this increase in rotation? Choices: "
        "A. Planetary density will decrease. B. Planetary years will become longer. "
        "C. Planetary days will become shorter. D. Planetary gravity will become stronger. "
        "Answer:"
    )


def test_five_choice_arc_question_gets_five_labels(data_root):
    record = next(r for r in load("arc_easy", data_root, "train") if len(r["choices"]) == 5)
    prompt = format_prompt(record, "arc_easy")
    assert f" E. {record['choices'][4]}" in prompt
    assert answer_labels(record, "arc_easy") == [" A", " B", " C", " D", " E"]


def test_obqa_prompt(data_root):
    record = load("obqa", data_root, "test")[0]
    assert format_prompt(record, "obqa") == (
        SELECT + "A person wants to start saving money so that they can afford a nice vacation "
        "at the end of the year. After looking over their budget and expenses, they decide the "
        "best way to save money is to Choices: A. make more phone calls. B. quit eating lunch "
        "out. C. buy less with monopoly money. D. have lunch with friends. Answer:"
    )


def test_boolq_prompt_and_labels(data_root):
    record = load("boolq", data_root, "test")[0]
    prompt = format_prompt(record, "boolq")
    assert prompt.startswith(
        "Answer the question with only True or False: does ethanol take more energy make that "
        "produces Context: Ethanol fuel -- All biomass goes through at least some of these steps"
    )
    assert prompt.endswith(" less petroleum than producing gasoline.")
    assert prompt == format_prompt({**record, "passage": record["passage"][:-1]}, "boolq")
    labels = answer_labels(record, "boolq")
    assert labels == [" False", " True"]
    assert labels[record["label"]] == " False"  # "label": false in val.jsonl


def test_winogrande_choice_pairs_fill_the_blank(data_root):
    record = load("winogrande_xs", data_root, "test")[0]
    assert choice_pairs(record, "winogrande_xs") == [
        ("Sarah was a much better surgeon than Maria so", "Sarah always got the easier cases."),
        ("Sarah was a much better surgeon than Maria so", "Maria always got the easier cases."),
    ]


def test_question_choice_pairs(data_root):
    record = load("obqa", data_root, "train")[0]
    pairs = choice_pairs(record, "obqa")
    assert pairs[3] == ("The sun is responsible for", "plants sprouting, blooming and wilting")
    assert len(pairs) == 4


@pytest.mark.parametrize("function", [format_prompt, answer_labels, choice_pairs])
def test_datasets_without_a_template_are_refused(function):
    with pytest.raises(ValueError, match="'sst2'"):
        function({"text": "fine", "label": 1}, "sst2")


def test_boolq_has_no_choice_pairs():
    with pytest.raises(ValueError, match="multiple-choice dataset"):
        choice_pairs({"question": "q", "passage": "p", "label": 1}, "boolq")
