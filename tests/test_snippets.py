"""The README's and the user guide's code blocks (tests/snippets.py says how they run).

Every block of the documents is run (the quick documents here, the others in
``validation/test_snippets.py``) or listed with the reason it cannot run here: a block added
without either fails here, so none is skipped silently.
"""

import pytest
from snippets import DOCUMENTS, NOT_RUN, QUICK, code_blocks, run_document


def test_every_block_runs_or_is_listed_with_its_reason():
    keys = [block.key for document in DOCUMENTS for block in code_blocks(document)]
    assert len(keys) == len(set(keys)), "two blocks share a first line: NOT_RUN cannot tell"
    unlisted = [
        block.key
        for document in DOCUMENTS
        for block in code_blocks(document)
        if block.language != "python" and block.key not in NOT_RUN
    ]
    assert not unlisted, f"blocks that cannot run (not Python) need a reason in NOT_RUN: {unlisted}"
    assert set(NOT_RUN) <= set(keys), (
        f"NOT_RUN lists blocks no document has: {set(NOT_RUN) - set(keys)}"
    )
    assert {block.document for d in DOCUMENTS for block in code_blocks(d)} >= {
        "README.md",
        "docs/getting_started.rst",
    }


@pytest.mark.parametrize("document", sorted(QUICK))
def test_quick_documents_give_what_they_say(document, tmp_path):
    run_document(document, tmp_path)
