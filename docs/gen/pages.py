"""The pages mkdocs-gen-files adds at build time (mkdocs.yml): the reference, generated from the
code (docs/gen/reference.py), and the performance plots, drawn from bench/results.json
(docs/gen/plots.py). Nothing here is committed as output, so none of it can go stale."""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmarks  # noqa: E402
import plots  # noqa: E402
import reference  # noqa: E402

ROOT = reference.ROOT
GENERATED = "<!-- generated at build time by docs/gen/pages.py: edit the code it reads, not this page -->\n\n"


def _anchor(words: tuple[str, ...]) -> str:
    """The heading `## cubeserve rollout canary`'s anchor (the toc extension's slug)."""
    from markdown.extensions.toc import slugify

    return slugify(" ".join(words), "-")


def cli_page() -> str:
    known = reference.commands()
    examples = reference.examples(known)
    shared = reference.shared_options(known)
    out = [GENERATED, "# Command line\n\n",
           "Every command's `--help`, as the installed commands print it (`.venv/bin/cubeserve`, "
           "`.venv/bin/cube3d-client`) in a terminal 80 columns wide, and an example of each. Generated "
           "from the argparse parsers in `cubeserve/cli.py`, `cubeserve/rollout/cli.py` and "
           "`client/cube3d_client/cli.py`; the examples are `EXAMPLES` in `docs/gen/reference.py`, "
           "each parsed by its command's parser in the tests.\n\n"]
    if shared:
        out.append("## Options shared by several commands\n\n"
                   "These options mean the same in every command that takes them, so they are listed "
                   "once here; each command's usage line below still shows them.\n\n")
        for i, group in enumerate(shared, 1):
            parser = known[group.commands[0]]
            takers = ", ".join(f"[`{' '.join(w)}`](#{_anchor(w)})" for w in group.commands)
            text = reference.options_text(parser, reference.shared_actions(parser, group)).rstrip()
            out.append(f"### {reference.shared_title(group, i)}\n\nTaken by {takers}:\n\n```text\n{text}\n```\n\n")
    for words, parser in known.items():
        groups = [(i, g) for i, g in enumerate(shared, 1) if words in g.commands]
        hide = frozenset(a for _, g in groups for a in reference.shared_actions(parser, g))
        out.append(f"## `{' '.join(words)}`\n\n```text\n{reference.help_text(parser, hide).rstrip()}\n```\n\n")
        if groups:
            out.append("Also takes the shared options: " + "; ".join(
                f"[{reference.shared_title(g, i)}](#{_anchor((reference.shared_title(g, i),))}) ("
                + ", ".join(f"`{k[0][-1]}`" for k in g.keys) + ")" for i, g in groups) + ".\n\n")
        if words in examples:
            out.append(f"Example:\n\n```bash\n{examples[words]}\n```\n\n")
        elif not reference.needs_example(parser):
            out.append("Its subcommands, below, do the work; each has its example.\n\n")
    return "".join(out)


# Where each file's families are registered, as the metrics page groups them.
METRIC_GROUPS = {
    "cubeserve/serving/triton_metrics.py": (
        "Requests, objects, shadows and tenants",
        "Recorded by the Triton models per request and per generated object (`serving/triton_metrics.py`)."),
    "cubeserve/serving/triton_engine.py": (
        "The engine's batch",
        "Recorded by the engine of `cube3d_stream`, per decode step and per object (`serving/triton_engine.py`)."),
    "cubeserve/serving/triton_common.py": (
        "Draining",
        "Recorded by every model instance; a drain waits for it to reach 0 (`serving/triton_common.py`)."),
}


def metrics_table(metrics) -> str:
    """A table (HTML: an example takes a whole row) of one row a family, its name (a code span that
    does not wrap: extra.css), type, unit, labels and what it means (its help), and under it a row
    of its PromQL example; the unit and the example are serving/metrics.py's UNIT_AND_EXAMPLE."""
    from html import escape

    out = ["<table>\n<thead><tr><th>name</th><th>type</th><th>unit</th>"
           "<th>labels beyond <code>model</code>, <code>version</code></th><th>what it means</th></tr></thead>\n"
           "<tbody>\n"]
    for m in metrics:
        out.append(f'<tr class="metric"><td><code class="metric-name">{escape(m.name)}</code></td>'
                   f"<td>{m.kind}</td><td>{escape(m.unit)}</td><td>{escape(m.labels) or 'none'}</td>"
                   f"<td>{escape(m.help)}</td></tr>\n"
                   f'<tr class="metric-example"><td colspan="5">PromQL: <code>{escape(m.example)}</code></td></tr>\n')
    out.append("</tbody>\n</table>\n")
    return "".join(out)


def metrics_page() -> str:
    metrics = reference.metrics()
    out = [GENERATED, "# Metrics\n\n",
           "Every metric family the server registers on its metrics port (8002), read from the code "
           "that registers it; each family's unit and PromQL example are in "
           "`cubeserve/serving/metrics.py` (`UNIT_AND_EXAMPLE`), next to the names, and the build fails "
           "for a family without them. What to alert on and how to read them: "
           "[Operations](../operations/index.md).\n\n",
           reference.metrics_intro().replace("\n", " ") + "\n\n",
           "A histogram `NAME` is exported as `NAME_bucket{le}`, `NAME_sum` and `NAME_count` (its "
           "buckets are in `cubeserve/serving/metrics.py`): its example reads `NAME_bucket`. A counter "
           "counts from 0 when tritonserver starts: query it through `rate()` or `increase()`.\n\n"]
    sources = {m.source for m in metrics}
    unknown = sources - set(METRIC_GROUPS)
    if unknown:
        raise LookupError(f"docs/gen/pages.py: METRIC_GROUPS has no heading for {sorted(unknown)}")
    for source, (title, intro) in METRIC_GROUPS.items():
        group = [m for m in metrics if m.source == source]
        if group:
            out.append(f"## {title}\n\n{intro}\n\n{metrics_table(group)}\n")
    return "".join(out)


def _docstring(module: str) -> str:
    import importlib

    return importlib.import_module(module).__doc__.strip()


def configuration_page() -> str:
    def file_block(path: str, lang: str) -> str:
        return f"`{path}`:\n\n```{lang}\n{(ROOT / path).read_text().rstrip()}\n```\n\n"

    return "".join([
        GENERATED, "# Configuration files\n\n",
        "The formats as the modules that read them document them, and the example files as they are "
        "in the repository.\n\n",
        "## The gateway file (YAML)\n\n`cubeserve gateway --config FILE` ([The gateway](../gateway/index.md)); "
        "read by `cubeserve/gateway/config.py`:\n\n",
        "```text\n" + _docstring("cubeserve.gateway.config") + "\n```\n\n",
        file_block("examples/gateway.yaml", "yaml"), file_block("examples/gateway-keys.yaml", "yaml"),
        "## The experiment (JSON)\n\nThe in-server A/B and shadow test ([Experiments](../serving/experiments.md)); "
        "read by `cubeserve/serving/experiment.py`:\n\n",
        "```text\n" + _docstring("cubeserve.serving.experiment") + "\n```\n\n",
        "## The Triton models' configuration\n\nThe parameters are described in "
        "[The predict API](../serving/api.md#model-parameters).\n\n",
        file_block("triton_models/cube3d_stream/config.pbtxt", "text"),
        file_block("triton_models/cube3d/config.pbtxt", "text"),
    ])


def main() -> None:
    for path, text in (("reference/cli.md", cli_page()), ("reference/metrics.md", metrics_page()),
                       ("reference/configuration.md", configuration_page())):
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(text)

    def write(name: str, data: bytes) -> None:
        with mkdocs_gen_files.open(f"performance/{name}", "wb") as f:
            f.write(data)

    # BENCHMARKS.md by subject: performance/benchmarks.md (its summary) and performance/benchmarks/*.md.
    for path, text in benchmarks.pages().items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(GENERATED.replace("edit the code it reads", "edit BENCHMARKS.md") + text)

    page = GENERATED + plots.draw(write)
    with mkdocs_gen_files.open("performance/plots.md", "w") as f:
        f.write(page)


main()
