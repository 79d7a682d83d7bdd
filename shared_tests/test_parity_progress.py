"""The parity report's progress and line width (shared_tests/parity.py): on a terminal one line
rewritten in place with the case running, done/remaining and the time left; piped or under CI a
plain line per finished group; no line of the report longer than LINE_WIDTH."""

import io
import re

from shared_tests import parity
from shared_tests.comparisons import Row


def _progress(total, live, names=None):
    stream = io.StringIO()
    progress = parity.Progress("cases", total, stream=stream, live=live)
    for index in range(total):
        progress.running(index, (names or {}).get(index, f"case_{index}"))
        progress.finished(index + 1)
    progress.close()
    return stream.getvalue()


def test_piped_progress_is_a_plain_line_per_finished_group():
    printed = _progress(25, live=False)
    assert "\r" not in printed
    lines = printed.splitlines()
    assert [line.split(" done")[0] for line in lines] == ["cases: 10/25", "cases: 20/25", "cases: 25/25"]
    assert all(re.search(r"done in \d+ s, about \d+ s left$", line) for line in lines[:-1])
    assert re.fullmatch(r"cases: 25/25 done in \d+ s", lines[-1])


def test_ci_counts_as_piped_even_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("CI", raising=False)  # CI itself runs the suite with CI=true
    assert parity.Progress("cases", 1, stream=Terminal()).live
    monkeypatch.setenv("CI", "true")
    assert not parity.Progress("cases", 1, stream=Terminal()).live


def test_terminal_progress_names_the_case_running_done_remaining_and_time_left():
    printed = _progress(3, live=True, names={1: "gqa"})
    frames = printed.split("\r")
    assert "cases: 0/3 done, 3 to go, time left not known yet; running case_0" in frames[1]
    assert re.search(r"cases: 1/3 done, 2 to go, about \d+ s left; running gqa", frames[2])
    assert frames[-1] == "" and frames[-2].strip() == ""  # the line is cleared at the end
    assert "\n" not in printed


def test_long_lines_wrap_within_the_line_width():
    reason = "a reason " * 60  # 540 characters
    text = parity.wrapped(f"  tf:litert  3 cases: {reason}\nshort")
    assert all(len(line) <= parity.LINE_WIDTH for line in text.splitlines())
    assert text.splitlines()[1].startswith(" " * 6) and text.splitlines()[-1] == "short"
    assert " ".join(text.split()) == " ".join(f"tf:litert 3 cases: {reason} short".split())


def test_not_run_reasons_wrap_in_the_report():
    """The verbose "Not run" lines name every case: printed, no line is longer than LINE_WIDTH."""
    names = [f"case_with_a_long_name_{i}" for i in range(40)]
    rows = [Row(name, "float32", {}, True, [], skipped={"tf:litert": "the converter refuses it"}) for name in names]
    text = parity.wrapped(parity.format_not_run(rows, [], verbose=True))
    assert all(len(line) <= parity.LINE_WIDTH for line in text.splitlines())
    assert all(name in text for name in names)
