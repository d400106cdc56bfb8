"""The benchmark reports say how they were made, and bench_paste copies them into the docs as
written: what keeps every number in docs/benchmarks.md tied to a script run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from bench_lib import report  # noqa: E402
from bench_paste import paste  # noqa: E402


def test_header_names_command_commit_date_and_machine():
    lines = report.header_lines()
    text = "\n".join(lines)
    head = subprocess.run(["git", "-C", str(SCRIPTS), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert re.search(rf"- commit: `{head}(-dirty)?`; date: \d{{4}}-\d\d-\d\d \d\d:\d\d UTC",
                     text)
    assert "- command: `" in text and "torch " in text and "sglang " in text
    assert f"{__import__('os').cpu_count()} cores" in text
    flags = next(line for line in lines if line.startswith("- CPU flags: "))
    cpuinfo = open("/proc/cpuinfo").read()
    have = set(next(line for line in cpuinfo.splitlines()
                    if line.startswith("flags")).partition(":")[2].split())
    for flag in ("avx2", "avx512f", "avx512_bf16"):  # the kernels' two paths are told apart
        assert (flag in flags.split()) == (flag in have), (flag, flags)


def test_paste_refills_every_block_from_its_file_and_nothing_else(tmp_path):
    (tmp_path / "a.md").write_text("- commit: `abc`\n\n| x |\n|---|\n| 1 |\n")
    (tmp_path / "b.md").write_text("B report\n")
    doc = ("# Title\nprose stays\n<!-- report: a.md -->\nold A\n<!-- end of report -->\n"
           "between\n<!-- report: b.md -->\n<!-- end of report -->\ntail\n")
    text, used = paste(doc, tmp_path)
    assert used == ["a.md", "b.md"]
    assert text == ("# Title\nprose stays\n<!-- report: a.md -->\n- commit: `abc`\n\n| x |\n"
                    "|---|\n| 1 |\n<!-- end of report -->\nbetween\n<!-- report: b.md -->\n"
                    "B report\n<!-- end of report -->\ntail\n")
    assert paste(text, tmp_path)[0] == text  # idempotent


def test_paste_names_a_report_not_written_yet(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.md does not exist: run the benchmark"):
        paste("<!-- report: missing.md -->\n<!-- end of report -->\n", tmp_path)
    # after a subset of the benchmarks (--present): that block keeps what it had
    (tmp_path / "new.md").write_text("new\n")
    doc = ("<!-- report: missing.md -->\nold\n<!-- end of report -->\n"
           "<!-- report: new.md -->\nstale\n<!-- end of report -->\n")
    kept: list[str] = []
    text, used = paste(doc, tmp_path, present=True, kept=kept)
    assert (used, kept) == (["new.md"], ["missing.md"])
    assert text == ("<!-- report: missing.md -->\nold\n<!-- end of report -->\n"
                    "<!-- report: new.md -->\nnew\n<!-- end of report -->\n")


def test_every_report_block_in_the_docs_carries_its_header():
    """Each pasted report in docs/benchmarks.md starts with the command, commit and date."""
    doc = (SCRIPTS.parent / "docs" / "benchmarks.md").read_text()
    blocks = re.findall(r"<!-- report: (\S+) -->\n(.*?)<!-- end of report -->", doc, re.DOTALL)
    assert blocks, "docs/benchmarks.md has no pasted report"
    for path, body in blocks:
        assert re.search(r"- command: `.*scripts/bench_\w+\.py", body), path
        assert re.search(r"- commit: `[0-9a-f]{7,}(-dirty)?`; date: \d{4}-", body), path


def test_a_request_bench_serving_counts_as_successful_but_cut_short_is_found():
    from bench_lib.serving_client import short_outputs

    good = {"output_lens": [4, 4], "generated_texts": ["a b", "c d"], "errors": ["", ""]}
    assert short_outputs(good, 4) == ""
    cut = {**good, "output_lens": [4, 3]}
    assert short_outputs(cut, 4).startswith("1 of 2 requests did not stream 4 tokens with text "
                                            "(request 1: 3 tokens")
    # aborted before any text: bench_serving reports the requested count and no text
    empty = {**good, "generated_texts": ["a b", ""]}
    assert "request 1: 4 tokens, 0 characters" in short_outputs(empty, 4)
    assert "no per-request output lengths" in short_outputs({}, 4)
