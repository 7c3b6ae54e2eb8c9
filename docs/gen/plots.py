"""The performance plots, drawn at build time from bench/results.json (docs/gen/pages.py writes
them into the site): each figure has at most MAX_SERIES series, each in its own colour and
marker, labelled by what differs between them (the machine and the model config go in the
title). A measurement that would crowd a figure is split into several by subject (one figure a
machine and config; the numerics modes into compute dtypes and quantized weights); a figure
that still has too many series fails the build (check_figure) instead of drawing a legend no
one can read.
"""

from __future__ import annotations

import io
import json
import re
import textwrap
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MAX_SERIES = 6
# Okabe and Ito's colour-blind-safe colours (yellow left out: too light on white), with markers,
# so that series differ in grey too.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
MARKERS = ("o", "s", "^", "D", "v", "P")
FONT = 9  # the smallest text in a figure (ticks, legends)


def records(path: Path = ROOT / "bench/results.json") -> tuple[dict, list[dict]]:
    """bench/results.json's `generated` and its records, a later record of a measurement
    replacing an earlier one."""
    data = json.loads(path.read_text())
    latest = {}
    for r in data["records"]:
        latest[(r["section"], r["device"], r["config"], r["mode"], r["objects_in_flight"])] = r
    return data["generated"], list(latest.values())


def styles(labels) -> dict[str, dict]:
    """A colour and a marker for each series of one figure, in sorted order: the same labels get
    the same colours in every figure."""
    labels = sorted(set(labels))
    if len(labels) > MAX_SERIES:
        raise ValueError(f"{len(labels)} series in one figure (at most {MAX_SERIES}): {labels}; "
                         "split it by subject in docs/gen/plots.py")
    return {label: {"color": COLOURS[i], "marker": MARKERS[i]} for i, label in enumerate(labels)}


def subject(mode: str) -> str:
    """A numerics mode's subject: the compute dtype alone, or weights quantized (`+int8`...)."""
    return "quantized weights" if "+" in mode else "compute dtype"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def check_figure(fig) -> None:
    """At most MAX_SERIES series in each panel, each in a colour of its own."""
    for ax in fig.axes:
        colours = [line.get_color() for line in ax.get_lines()]
        colours += [c.patches[0].get_facecolor() for c in ax.containers if c.patches]
        if len(colours) > MAX_SERIES:
            raise ValueError(f"{ax.get_title()!r}: {len(colours)} series (at most {MAX_SERIES})")
        if len({str(c) for c in colours}) != len(colours):
            raise ValueError(f"{ax.get_title()!r}: two series share a colour")


def _svg(fig) -> bytes:
    check_figure(fig)
    buf = io.BytesIO()
    # No timestamps or ids that change between builds: the same results give the same file.
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue()


def _machine(device: str) -> str:
    return "CPU (the record names no machine)" if device == "cpu" else device


def _plain_log_ticks(ax, xs) -> None:
    """Log axes labelled in plain numbers, x at the batch sizes measured."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xticks(sorted(set(xs)), [str(x) for x in sorted(set(xs))])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))


def _short_devices(devices) -> dict[str, str]:
    """Each machine by what tells it from the others ("AVX2"), the parts all share left out."""
    parts = {d: d.split(", ") for d in devices}
    common = set.intersection(*(set(p) for p in parts.values())) if len(parts) > 1 else set()
    return {d: ", ".join(x for x in p if x not in common) or d for d, p in parts.items()}


def _wrapped(text: str, width: int = 18) -> str:
    return "\n".join(textwrap.wrap(text, width))


def draw(write, results: tuple[dict, list[dict]] | None = None) -> str:
    """Draw the figures with write(name, svg bytes); return the plots page (from its title on)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "cube-serve"
    matplotlib.rcParams.update({"font.size": FONT + 1, "axes.titlesize": FONT + 2, "legend.fontsize": FONT,
                                "xtick.labelsize": FONT, "ytick.labelsize": FONT})
    import matplotlib.pyplot as plt

    generated, recs = results or records()
    page = ["# Plots\n\n",
            f"Drawn at build time from `bench/results.json` (written by `make bench` and the benchmark "
            f"modules; generated {generated.get('date', '?')}, {generated.get('hardware', '?')}). The "
            "tables, and what each run measured on which machine, are in [Benchmarks](benchmarks.md). "
            f"Each plot has at most {MAX_SERIES} series; a measurement of more is split by subject.\n\n"]

    # Decode throughput: tokens/s = objects in flight / time per step (ms_per_token is one step),
    # one figure a machine and config: the modes of one run, side by side.
    lines = defaultdict(lambda: defaultdict(list))
    for r in recs:
        if r["ms_per_token"] and r["section"] in ("engine", "quantization"):
            lines[(r["device"], r["config"])][r["mode"]].append(
                (r["objects_in_flight"], r["objects_in_flight"] * 1000 / r["ms_per_token"]))
    page.append("## Tokens per second vs batch\n\nShape tokens per second of the decode loop against "
                "the objects decoding together (`engine` and `quantization` sections), one plot a machine "
                "and model config; a mode measured at one batch size only is left out.\n\n")
    for (device, config), modes in sorted(lines.items()):
        modes = {m: sorted(p) for m, p in modes.items() if len(p) > 1}
        if not modes:
            continue
        style = styles(modes)
        fig, ax = plt.subplots(figsize=(7, 4))
        for mode, points in sorted(modes.items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=mode, **style[mode])
        ax.set(xscale="log", yscale="log", xlabel="objects in flight (batch)", ylabel="shape tokens / s",
               title=f"Decode throughput, {config} config, {_machine(device)}")
        _plain_log_ticks(ax, [x for points in modes.values() for x, _ in points])
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), title="mode")
        name = f"tokens-per-second-{slug(config)}-{slug(device)}.svg"
        write(name, _svg(fig))
        plt.close(fig)
        page.append(f"### {config} config, {_machine(device)}\n\n"
                    f"![decode throughput vs batch, {config} config, {_machine(device)}]({name})\n\n")

    # Time per object through the server against in process, by concurrency.
    lines = defaultdict(list)
    for r in recs:
        if r["section"] == "server_overhead" and r["objects_per_second"]:
            lines[r["mode"]].append((r["objects_in_flight"], 1 / r["objects_per_second"]))
    if lines:
        style = styles(lines)
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, points in sorted(lines.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, label=mode, **style[mode])
        ax.set(xlabel="requests in flight", ylabel="seconds per object (1 / throughput)",
               title="Server overhead vs concurrency (tiny config)")
        ax.legend()
        write("latency-vs-concurrency.svg", _svg(fig))
        plt.close(fig)
        page.append("## Time per object vs concurrency\n\nThe same requests in process and through Triton's "
                    "REST and gRPC endpoints (`server_overhead` section).\n\n"
                    "![time per object vs concurrency](latency-vs-concurrency.svg)\n\n")

    # Numerics: each mode's teacher-forced top-1 agreement with the float32 oracle, and its KL,
    # one figure a subject (compute dtypes; quantized weights), bars grouped by config and machine.
    by_subject = defaultdict(lambda: defaultdict(dict))
    for r in recs:
        if r["section"].startswith("numerics") and r["extra"].get("agreement") is not None:
            by_subject[subject(r["mode"])][(r["config"], r["device"])][r["mode"]] = r["extra"]
    page.append("## Numerics per mode\n\nEach mode against the float32 oracle on the same weights and "
                "prompts (`numerics` sections; higher agreement and lower KL are closer), one plot for the "
                "compute dtypes and one for the quantized weights. The oracle itself (float32) has KL 0, "
                "which a log axis cannot show.\n\n")
    for topic, groups in sorted(by_subject.items()):
        groups = dict(sorted(groups.items()))
        modes = sorted({m for g in groups.values() for m in g})
        style = styles(modes)
        fig, axes = plt.subplots(2, 1, figsize=(9, 8), layout="constrained")
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs = [j + i * width for j, g in enumerate(groups.values()) if mode in g]
            ys = [g[mode] for g in groups.values() if mode in g]
            colour = style[mode]["color"]
            axes[0].bar(xs, [y["agreement"] for y in ys], width, label=mode, color=colour)
            kl = [(x, y["kl"]) for x, y in zip(xs, ys) if y["kl"]]
            if kl:
                axes[1].bar(*zip(*kl), width, color=colour)
        short = _short_devices({device for _, device in groups})
        ticks = [f"{config}\n{_wrapped(short[device], 24)}" for config, device in groups]
        for ax in axes:
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], ticks)
        axes[0].set(ylabel="top-1 agreement\n(teacher forced)", ylim=(0, 1.02),
                    title=f"Agreement with float32: {topic}")
        axes[1].set(ylabel="KL from float32", yscale="log", title=f"KL divergence: {topic}")
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=min(len(modes), 3),
                   title="mode")
        machines = sorted({device for _, device in groups})
        fig.suptitle("; ".join(machines), fontsize=FONT)
        name = f"numerics-{slug(topic)}.svg"
        write(name, _svg(fig))
        plt.close(fig)
        page.append(f"### {topic.capitalize()}\n\n![numerics per mode: {topic}]({name})\n\n")
    return "".join(page)
