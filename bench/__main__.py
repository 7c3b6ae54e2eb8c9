"""`make bench`: run the benchmarks on whatever device is present, write BENCHMARKS.md's
generated section and bench/results.json."""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import traceback
from pathlib import Path

import torch

from bench import engine_speed, front_overhead, server_overhead
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
    parser.add_argument("--only", choices=["engine", "server", "front"], help="run one section")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    header = {"date": when, "hardware": hardware(device), "torch": torch.__version__}
    if device.type == "cuda":
        # 256 timed steps per measurement keep both configs inside the GPU check's budget.
        engine_runs = [("engine-gpu-" + c, lambda c=c: engine_speed.run(c, device, torch.bfloat16,
                                                                          flights=(1, 8, 32, 64), window=256))
                       for c in ("v0.1", "v0.5")]
    else:
        window = 8 if args.quick else None  # None: the whole object
        engine_runs = [("engine-cpu", lambda: engine_speed.run("mid", device, torch.float32, flights=(1, 8, 32),
                                                                window=window, resolutions=(5, 6, 7, 8),
                                                                dense_max_resolution=7))]
    sections = dict(engine_runs)
    if device.type == "cpu":  # the Triton comparison runs the tiny model on the CPU
        sections["server"] = server_overhead.run
        sections["front"] = front_overhead.run
    failed = []
    for name, run in sections.items():
        if args.only and not name.startswith(args.only):
            continue
        try:
            records, lines = run()
        except Exception:  # one section's failure must not lose the others' figures
            traceback.print_exc()
            print(f"section {name} FAILED; going on with the others", flush=True)
            failed.append(name)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        write_results(records, header)
        lines = [f"Measured {when} on {header['hardware']}, torch {header['torch']}.", "", *lines]
        update_markdown(name, lines)
        print("\n".join(lines), flush=True)
    if failed:
        sys.exit(f"failed sections: {', '.join(failed)}")


if __name__ == "__main__":
    main()
