"""`make bench`: run the benchmarks on whatever device is present, write BENCHMARKS.md's
generated section and bench/results.json."""

from __future__ import annotations

import argparse
import datetime
import re
from pathlib import Path

import torch

from bench import server_overhead
from bench.common import hardware, write_results

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
BEGIN, END = "<!-- bench:{section}:begin -->", "<!-- bench:{section}:end -->"


def update_markdown(section: str, lines: list[str]) -> None:
    begin, end = BEGIN.format(section=section), END.format(section=section)
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    block = "\n".join([begin, *lines, end])
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["server"], help="run one section")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    header = {"date": when, "hardware": hardware(device), "torch": torch.__version__}
    sections = {"server": server_overhead.run}
    for name, run in sections.items():
        if args.only and args.only != name:
            continue
        records, lines = run()
        write_results(records, header)
        lines = [f"Measured {when} on {header['hardware']}, torch {header['torch']}.", "", *lines]
        update_markdown(name, lines)
        print("\n".join(lines))


if __name__ == "__main__":
    main()
