"""BENCHMARKS.md on the site as pages by subject, cut from it at build time (docs/gen/pages.py
writes them): performance/benchmarks.md is its start (the title, what the figures are, the
Summary) with a list of the subject pages, and each subject page holds BENCHMARKS.md's `##`
sections of that subject, as written, in the file's order. BENCHMARKS.md itself stays one file
(`make bench` rewrites sections of it between markers; tests read it whole); only links to a
heading on another page are pointed at that page. A `##` section no subject claims fails the
build: add its heading to SUBJECTS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDER = "performance/benchmarks"  # the subject pages, under the site's docs

# (page, title, what it holds, the `##` headings of BENCHMARKS.md it takes, by how they start).
SUBJECTS = (
    ("engine", "The engine", "The decode loop and geometry on the CPU and a GPU, window decoding and the "
     "scheduler's path.",
     ("Engine on the CPU", "Engine on a GPU", "Parallel token generation", "`Engine.generate_tokens`")),
    ("numerics", "Numerics and quantization", "Each numerics mode's agreement with the float32 oracle, "
     "and its speed and weight memory.",
     ("Numerics: agreement", "Numerics modes")),
    ("server", "The server", "What Triton and the front ends add, load and soak, slow clients and shared "
     "nodes.",
     ("Server overhead", "Load and soak", "The front ends", "Slow and silent clients", "Shared CPU nodes")),
    ("gateway", "The gateway", "What the gateway adds, its regions and routing, and one request's trace.",
     ("The gateway",)),
    ("capacity", "Capacity and batch", "What one replica serves, its cold start, and batch generation on "
     "Ray.",
     ("Capacity of one replica", "Batch generation on Ray Data")),
)


@dataclass
class Page:
    path: str  # under docs/, e.g. performance/benchmarks/engine.md
    title: str
    text: str  # the page as BENCHMARKS.md has it, before links are pointed at other pages


def anchor(heading: str) -> str:
    """A heading's anchor as the toc extension makes it (code spans' backticks dropped)."""
    from markdown.extensions.toc import slugify

    return slugify(heading.replace("`", ""), "-")


def sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """BENCHMARKS.md as its start (up to the first `##` heading) and its `##` sections, each
    (heading, text from its heading line on). A `##` inside a fenced block is no heading."""
    start, out, fence = [], [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("## "):
            out.append((line[3:].strip(), ""))
        if out:
            out[-1] = (out[-1][0], out[-1][1] + line)
        else:
            start.append(line)
    return "".join(start), out


def split(text: str) -> list[Page]:
    """The summary page (BENCHMARKS.md's start and its Summary, and any section before the first
    one a subject takes) and one page a subject."""
    start, found = sections(text)
    pages = {name: Page(f"{FOLDER}/{name}.md", title, f"# {title}\n\n{intro} These are BENCHMARKS.md's sections "
                        "on it, as `make bench` and the benchmark modules wrote them; the figures for planning "
                        "capacity are its [summary](../benchmarks.md#summary).\n\n")
             for name, title, intro, _ in SUBJECTS}
    summary = Page("performance/benchmarks.md", "Benchmarks", start)
    unclaimed = []
    for heading, body in found:
        owner = next((name for name, _, _, prefixes in SUBJECTS if heading.startswith(prefixes)), None)
        if owner:
            pages[owner].text += body
        elif heading == "Summary":
            summary.text += body
        else:
            unclaimed.append(heading)
    if unclaimed:
        raise LookupError(f"BENCHMARKS.md's sections {unclaimed} belong to no subject page: add each "
                          "heading's start to SUBJECTS in docs/gen/benchmarks.py")
    empty = [p.path for p in pages.values() if "\n## " not in p.text]
    if empty:
        raise LookupError(f"subject pages no section of BENCHMARKS.md fills: {empty} (docs/gen/benchmarks.py)")
    return [summary, *pages.values()]


def _relative(target: str, origin: str) -> str:
    import posixpath

    return posixpath.relpath(target, posixpath.dirname(origin))


def render(text: str) -> dict[str, str]:
    """path under docs/ -> the page's Markdown: links to a heading (`#anchor`) on another page
    point at that page, and the summary page lists the subject pages and their sections."""
    pages = split(text)
    home = {}  # anchor -> the page whose heading it is
    for page in pages:
        for heading in re.findall(r"^#{2,6} (.+)$", page.text, re.M):
            home.setdefault(anchor(heading), page.path)

    def relink(page: Page) -> str:
        def one(match: re.Match) -> str:
            target = home.get(match[2])
            if target is None or target == page.path:
                return match[0]
            return f"]({_relative(target, page.path)}#{match[2]})"

        return re.sub(r"\]\((#([^)\s]+))\)", one, page.text)

    out = {page.path: relink(page) for page in pages}
    summary = pages[0]
    listing = ["\n## By subject\n\nThe sections below the Summary, one page a subject (the navigation's "
               "*Benchmarks by subject*):\n\n"]
    for page in pages[1:]:
        headings = re.findall(r"^## (.+)$", page.text, re.M)
        links = "; ".join(f"[{h}]({_relative(page.path, summary.path)}#{anchor(h)})" for h in headings)
        listing.append(f"- [{page.title}]({_relative(page.path, summary.path)}): {links}\n")
    out[summary.path] = out[summary.path].rstrip("\n") + "\n" + "".join(listing)
    return out


def pages(path: Path = ROOT / "BENCHMARKS.md") -> dict[str, str]:
    return render(path.read_text())
