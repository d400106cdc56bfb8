"""Paste the benchmark reports into docs/benchmarks.md.

Every block of the doc between ``<!-- report: .cache/bench/NAME.md -->`` and
``<!-- end of report -->`` is replaced by that file, as the benchmark script wrote it (the
header with command, commit, date and machine, then the tables). A report's plot, when the
script made one (``.cache/bench/NAME.png``), is copied to ``docs/img/NAME.png``. Nothing else
in the doc changes. (Scripts write only under .cache, so a run never finds the work tree
dirty because of an earlier one.) Run it after the benchmark scripts:

    .venv/bin/python scripts/bench_paste.py [--doc docs/benchmarks.md] [--present]

``--present`` (what ``bench_all.sh`` passes when it ran a subset): refill only the blocks whose
report exists, leave the others as they are and name them.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- report: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- end of report -->)",
                   re.DOTALL)


def paste(doc: str, root: Path, present: bool = False,
          kept: list[str] | None = None) -> tuple[str, list[str]]:
    """``doc`` with every report block refilled from its file under ``root``; the files used.

    Raises ``FileNotFoundError`` naming the first report that has not been written yet, unless
    ``present``: such a block stays as it is (its path appended to ``kept``).
    """
    used = []

    def refill(match: re.Match) -> str:
        path = root / match["path"]
        if not path.is_file():
            if present:
                if kept is not None:
                    kept.append(match["path"])
                return match[0]
            raise FileNotFoundError(f"{match['path']} does not exist: run the benchmark that "
                                    "writes it first")
        used.append(match["path"])
        return match[1] + path.read_text().rstrip("\n") + "\n" + match[4]

    return BLOCK.sub(refill, doc), used


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md",
                        help="the markdown file to refill; default docs/benchmarks.md")
    parser.add_argument("--present", action="store_true",
                        help="refill only the blocks whose report exists (after a subset of "
                        "the benchmarks); the others stay as they are")
    args = parser.parse_args()
    try:
        doc = args.doc.read_text()
    except OSError as exc:
        print(f"bench_paste: error: cannot read {args.doc}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        kept: list[str] = []
        text, used = paste(doc, ROOT, args.present, kept)
    except FileNotFoundError as exc:
        print(f"bench_paste: error: {exc}", file=sys.stderr)
        return 1
    if not used:
        print(f"bench_paste: error: {args.doc} has no '<!-- report: PATH -->' block",
              file=sys.stderr)
        return 1
    args.doc.write_text(text)
    print(f"bench_paste: {args.doc}: pasted {', '.join(used)}")
    if kept:
        print(f"bench_paste: kept as they were (no report yet): {', '.join(kept)}")
    for report in used:
        plot = (ROOT / report).with_suffix(".png")
        if plot.is_file():
            target = args.doc.parent / "img" / plot.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plot, target)
            print(f"bench_paste: copied {plot.relative_to(ROOT)} to {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
