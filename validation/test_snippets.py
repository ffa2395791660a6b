"""The README's and the user guide's code blocks that take longer than the quick tier
allows (their own step counts on tiny stand-ins; tests/snippets.py says how they run)."""

import time

import pytest
from snippets import DOCUMENTS, QUICK, run_document


@pytest.mark.parametrize("document", sorted(set(DOCUMENTS) - QUICK))
def test_documents_give_what_they_say(document, tmp_path, report):
    started = time.perf_counter()
    run_document(document, tmp_path)
    report("snippets", document=document, seconds=time.perf_counter() - started)
