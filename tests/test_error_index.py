"""The error index (runbooks/errors.md): at least 60 stable messages, each real, each on the page
it points to, and every message that a runbook or lesson quotes covered by one of them.

"Real" means: found in the installed torch (Python sources, or the bytes of its shared libraries
and of the C/C++ runtime it loads), or listed in the index's source table with the file and line
that prints it at a named version (CUDA builds, NCCL, older releases), and then NOT in the
installed torch, so that table never hides a message that a CPU run could check.
"""

import re

import pytest

import error_index as ix  # tools/error_index.py (conftest puts tools/ on the path)

RUNBOOKS = ix.ROOT / "runbooks"
ENTRIES = ix.parse_index()
IN_TABLES_BY_AREA = [e for e in ENTRIES if not e.source]
FROM_SOURCE = [e for e in ENTRIES if e.source]
SOURCE_CELL = re.compile(r"`[\w./+-]+\.(?:cpp|cc|h|hpp|py|cu|c):\d+` @ "
                         r"(?:v\d+\.\d+(?:\.\d+)?(?:-\d+)?|[0-9a-f]{7,40}\b)")


def test_the_index_has_at_least_60_distinct_messages():
    messages = [e.message for e in ENTRIES]
    assert len(set(messages)) == len(messages), "an entry is listed twice"
    assert len(messages) >= 60, len(messages)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.message[:40])
def test_each_entry_is_a_stable_substring(entry):
    assert not ix.unstable_parts(entry.message), (entry.message, ix.unstable_parts(entry.message))


def test_every_entry_by_area_occurs_in_the_installed_torch():
    missing = [e.message for e in IN_TABLES_BY_AREA
               if not ix.where_in_torch(e.message, formatted=True)]
    assert not missing, f"not in the installed torch (move to the source table with a source): {missing}"


def test_source_table_entries_name_file_line_and_version_and_are_not_installed():
    assert FROM_SOURCE, "the source table is empty"
    for entry in FROM_SOURCE:
        assert entry.kind in {"GPU only", "older release", "reported, no source line"}, entry
        if entry.kind == "reported, no source line":  # the report, and what was searched
            assert re.search(r"#\d+", entry.source) and "Not in" in entry.source, entry
        else:
            assert SOURCE_CELL.search(entry.source), f"{entry.message!r}: source {entry.source!r}"
        found = ix.where_in_torch(entry.message)
        assert not found, f"{entry.message!r} is in the installed torch ({found}): check it there"


@pytest.mark.parametrize("variant", ["total capacty", "waiting for workers", "useIpv6: 0",
                                     "useIpv6: false", "torch.cuda.OutOfMemoryError",
                                     "torch.OutOfMemoryError", "FlightRecorder is disabled"])
def test_the_variants_across_versions_are_listed(variant):
    assert any(variant in e.message for e in ENTRIES), variant


def test_each_entry_is_on_the_page_it_points_to():
    for entry in ENTRIES:
        page = entry.page.split("#")[0]
        text = (RUNBOOKS / page).read_text()
        assert entry.message in text.replace("\\|", "|"), f"{page} does not show {entry.message!r}"


def test_every_quoted_message_contains_an_index_entry():
    uncovered = ix.uncovered_quotes(ENTRIES, ix.quoting_pages())
    assert not uncovered, "\n".join(f"{page}: {quote[:160]}" for page, quote in uncovered)


def test_the_checks_can_fail():
    assert ix.unstable_parts("connect to 127.0.0.1:29500 failed")
    assert ix.unstable_parts("at /opt/conda/lib/python3.11/x.py:12")
    assert ix.unstable_parts("[Rank 3] Watchdog")
    assert not ix.where_in_torch("this message is in no torch build 7f3a")
    assert not ix.where_in_torch("useIpv6: 0") and ix.where_in_torch("useIpv6: 0", formatted=True)
    page = {"p.md": "## Symptoms\n\n```\nRuntimeError: an error nobody indexed\n```\n"}
    assert ix.uncovered_quotes([ix.Entry("Timed out waiting", "x.md")], page) == [
        ("p.md", "RuntimeError: an error nobody indexed")]
    assert not SOURCE_CELL.search("`ProcessGroupNCCL.cpp` @ main")
