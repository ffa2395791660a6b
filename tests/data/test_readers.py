import pytest

from pyro_bdl.data import read_gutenberg

HEADER = "\ufeffThe Project Gutenberg EBook of Tiny, by Nobody\r\n\r\nLicence text.\r\n"
START = "*** START OF THIS PROJECT GUTENBERG EBOOK TINY ***\r\n"
END = "*** END OF THIS PROJECT GUTENBERG EBOOK TINY ***\r\n"
FOOTER = "Updated editions will replace the previous one.\r\n"


def test_gutenberg_body_is_what_lies_between_the_markers(tmp_path):
    credit = "Produced by A. Volunteer\r\nand B. Helper\r\n\r\n\r\n"
    body = credit + "TINY\r\n\r\nChapter 1\r\nIt began.\r\n"
    closing = "\r\nEnd of the Project Gutenberg EBook of Tiny, by Nobody\r\n\r\n"
    path = tmp_path / "1.txt"
    path.write_bytes((HEADER + START + body + closing + END + FOOTER).encode("utf-8"))
    assert read_gutenberg(path) == "TINY\n\nChapter 1\nIt began."


def test_gutenberg_marker_variants(tmp_path):
    path = tmp_path / "2.txt"
    text = "***START OF THE PROJECT GUTENBERG EBOOK X***\nBody.\n***END OF THE PROJECT GUTENBERG***"
    path.write_text(text)
    assert read_gutenberg(path) == "Body."


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            HEADER + "Body.\r\n" + END,
            r"3\.txt: expected .* '\*\*\* START OF' marker line, found none",
        ),
        (HEADER + START + "Body.\r\n", r"3\.txt: expected an '\*\*\* END OF' marker line .*line 4"),
    ],
)
def test_gutenberg_without_markers_names_the_file(tmp_path, text, message):
    path = tmp_path / "3.txt"
    path.write_text(text, newline="")
    with pytest.raises(ValueError, match=message):
        read_gutenberg(path)
