"""What the generated reference pages are made of, read from the code at build time, so the docs
cannot drift from it: the command line (every argparse parser of `cubeserve` and `cube3d-client`),
the metrics (the families the Triton models register) and the configuration files (their
formats as the modules that read them document them). docs/gen/pages.py writes the pages;
tests/test_docs.py uses the same functions to check what the hand-written pages mention.
"""

from __future__ import annotations

import argparse
import ast
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# -- the command line -------------------------------------------------------------------------------

def _walk(parser: argparse.ArgumentParser, words: tuple[str, ...]):
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, words + (name,))


def commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command and subcommand, ("cubeserve", "rollout", "canary") -> its parser."""
    from cube3d_client.cli import build_parser as client_parser
    from cubeserve.cli import build_parser

    return {**dict(_walk(build_parser(), ("cubeserve",))), **dict(_walk(client_parser(), ("cube3d-client",)))}


class _Columns:
    """$COLUMNS at 80 while argparse formats: what a terminal 80 columns wide prints."""

    def __enter__(self):
        self.old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "80"

    def __exit__(self, *exc):
        if self.old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = self.old


def help_text(parser: argparse.ArgumentParser, hide: frozenset[argparse.Action] = frozenset()) -> str:
    """`--help` as a terminal 80 columns wide prints it (argparse reads $COLUMNS): it fits the page.
    The options in `hide` (shared ones, shown once elsewhere) are left out of the option list but
    stay in the usage line, which is the full one."""
    with _Columns():
        if not hide:
            return parser.format_help()
        usage = parser.format_usage()
        saved = {a: a.help for a in hide}
        try:
            for action in hide:
                action.help = argparse.SUPPRESS
            rest = parser.format_help().split("\n\n", 1)[1]  # what follows the (shorter) usage
        finally:
            for action, text in saved.items():
                action.help = text
        return f"{usage}\n{rest}"


def options_text(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> str:
    """Some options of a parser as its `--help` lists them, 80 columns wide."""
    with _Columns():
        formatter = parser._get_formatter()
        formatter.start_section("options")
        formatter.add_arguments(actions)
        formatter.end_section()
        return formatter.format_help()


def _option_key(action: argparse.Action) -> tuple:
    """What makes an option the same one in two commands: its flags, help, default, choices,
    metavar and type as the parser holds them."""
    return (tuple(action.option_strings), action.help, repr(action.default), repr(action.choices),
            repr(action.metavar), getattr(action.type, "__name__", repr(action.type)), repr(action.nargs))


@dataclass(frozen=True)
class SharedOptions:
    commands: tuple[tuple[str, ...], ...]  # the commands that take every one of them
    keys: tuple[tuple, ...]  # _option_key of each, in the order of the first command's parser


def shared_options(known: dict[tuple[str, ...], argparse.ArgumentParser] | None = None) -> list[SharedOptions]:
    """Options that several commands take as the same option (same flags, help text, default,
    choices: the rollout commands' cluster options, say), grouped by the commands that take
    them: the CLI page shows each group once. An option without a help text is not shared:
    the same flag may mean different things to two commands."""
    known = commands() if known is None else known
    takers: dict[tuple, list[tuple[str, ...]]] = {}
    order: list[tuple] = []
    for words, parser in known.items():
        for action in parser._actions:
            if action.option_strings and action.help and action.help != argparse.SUPPRESS \
                    and not isinstance(action, argparse._HelpAction):
                key = _option_key(action)
                if key not in takers:
                    order.append(key)
                takers.setdefault(key, []).append(words)
    groups: dict[tuple, list[tuple]] = {}
    for key in order:
        if len(takers[key]) > 1:
            groups.setdefault(tuple(takers[key]), []).append(key)
    return [SharedOptions(words, tuple(keys)) for words, keys in groups.items()]


# A group of shared options' heading on the CLI page, by the first option's last flag; a group
# not named here is headed "Shared options N".
SHARED_TITLES = {
    "--namespace": "The cluster and its objects (rollout)",
    "--dry-run": "Changing the cluster (rollout)",
    "--wait": "Waiting for KServe (rollout)",
}


def shared_title(group: SharedOptions, number: int) -> str:
    return SHARED_TITLES.get(group.keys[0][0][-1], f"Shared options {number}")


def shared_actions(parser: argparse.ArgumentParser, group: SharedOptions) -> list[argparse.Action]:
    keys = set(group.keys)
    return [a for a in parser._actions if a.option_strings and _option_key(a) in keys]


# One real example a command, on the CLI page: each parses with its command's parser (tests/test_docs.py),
# and the ones marked in the comment were run as written. Commands that only hold subcommands
# (`cubeserve weights`, `cubeserve rollout`) have none: their subcommands' examples are theirs.
EXAMPLES = {
    ("cubeserve",): "cubeserve --verbose info --config tiny",  # run
    ("cubeserve", "generate"): 'cubeserve generate "a red chair" --weights models/demo --out chair.glb --seed 0',  # run
    ("cubeserve", "window-check"): "cubeserve window-check --weights models/demo --windows 1,4,8,16 "
                                   "--json window-check.json",
    ("cubeserve", "batch"): "cubeserve batch prompts.jsonl --weights models/demo --out outputs/catalogue "
                            "--resolution 6 --preview",
    ("cubeserve", "info"): "cubeserve info --config v0.1 --json",  # run
    ("cubeserve", "weights", "init"): "cubeserve weights init --config tiny --seed 1 --out outputs/ckpt",  # run
    ("cubeserve", "weights", "check"): "cubeserve weights check outputs/ckpt",  # run, after the init above
    ("cubeserve", "serve"): "cubeserve serve --http-port 8000 --grpc-port 8001 --metrics-port 8002",
    ("cubeserve", "demo"): 'cubeserve demo --prompt "a wooden chair" --out outputs/chair.glb --seed 0',
    ("cubeserve", "gateway"): "cubeserve gateway --config examples/gateway.yaml --check",  # run
    ("cubeserve", "usage"): "cubeserve usage --prometheus http://127.0.0.1:9090 --since 24h --csv",
    ("cubeserve", "train"): "cubeserve train all --work-dir outputs/demo-train --out outputs/demo-model",
    ("cubeserve", "evaluate"): "cubeserve evaluate models/demo --shapes 8 --json",
    ("cubeserve", "rollout", "status"): "cubeserve rollout status -n models --json",
    ("cubeserve", "rollout", "canary"): "cubeserve rollout canary --version 2 --percent 10 --dry-run",
    ("cubeserve", "rollout", "promote"): "cubeserve rollout promote --wait 900",
    ("cubeserve", "rollout", "rollback"): "cubeserve rollout rollback --wait 900",
    ("cubeserve", "rollout", "ab"): "cubeserve rollout ab --set control=1:90,candidate=2:10 --name decoder-v2",
    ("cubeserve", "rollout", "version-set"): "cubeserve rollout version-set --versions 1,2 --dry-run",
    ("cubeserve", "rollout", "analyze"): "cubeserve rollout analyze --prometheus http://prometheus.monitoring.svc:9090 "
                                         "--candidate 2 --baseline 1 --window 10m",
    ("cube3d-client",): 'cube3d-client "a red chair" --url 127.0.0.1:8000 --out chair.glb --seed 0',
}


def needs_example(parser: argparse.ArgumentParser) -> bool:
    """A command that does something itself: it takes an argument or an option beyond --help and
    its subcommand."""
    return any(not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) for a in parser._actions)


def examples(known: dict[tuple[str, ...], argparse.ArgumentParser] | None = None) -> dict[tuple[str, ...], str]:
    """EXAMPLES, checked: every command that needs one has one and every one is a command's; the
    docs build fails otherwise."""
    known = commands() if known is None else known
    missing = [" ".join(w) for w, p in known.items() if needs_example(p) and w not in EXAMPLES]
    unknown = [" ".join(w) for w in EXAMPLES if w not in known]
    if missing or unknown:
        raise LookupError(f"docs/gen/reference.py's EXAMPLES: commands without an example: {missing}; "
                          f"examples of no command: {unknown}")
    for words, example in EXAMPLES.items():
        assert example.split()[:len(words)] == list(words), f"{example!r} is not an example of {' '.join(words)}"
    return dict(EXAMPLES)


# -- the metrics --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter, gauge, histogram
    help: str  # the description the server registers (Prometheus' HELP line)
    labels: str  # labels beyond model and version
    source: str  # the file that registers it
    unit: str = ""  # from serving/metrics.py's UNIT_AND_EXAMPLE
    example: str = ""  # a PromQL query of it, from the same place


def _families_literal(path: Path, name: str) -> ast.expr:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return node.value
    raise LookupError(f"{path}: no {name} =")


def _measurement_labels(tree: ast.AST) -> dict[str, set[str]]:
    """The label names each family gets in triton_metrics.Measurements: for every
    `self.count(names.X, {...})` or `self.observe(names.X, {...})`, the dict's keys, with a
    method's local `labels = {...}` opened where it is spread (`**labels`)."""
    from cubeserve.serving import metrics as names

    def key(node: ast.expr) -> str:  # "outcome", or names.GATEWAY_MODEL_LABEL's value
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "names":
            return getattr(names, node.attr)
        raise LookupError(f"a label key docs/gen/reference.py cannot read: {ast.unparse(node)}")

    out: dict[str, set[str]] = {}
    for method in ast.walk(tree):
        if not isinstance(method, ast.FunctionDef):
            continue
        local: set[str] = set()
        for node in ast.walk(method):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and any(getattr(t, "id", None) == "labels" for t in node.targets)):
                local = {key(k) for k in node.value.keys if k is not None}
        for node in ast.walk(method):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("count", "observe")
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Attribute)):
                keys = out.setdefault(node.args[0].attr, set())
                arg = node.args[1]
                if isinstance(arg, ast.Name) and arg.id == "labels":
                    keys |= local
                elif isinstance(arg, ast.Dict):
                    for k in arg.keys:
                        keys |= local if k is None else {key(k)}
    return out


def metrics() -> list[Metric]:
    """Every metric family the server registers. serving/triton_metrics.py and
    serving/triton_engine.py import Triton's python backend, which exists only inside tritonserver,
    so their registrations are read from the source: _FAMILIES is evaluated as written (names
    from serving/metrics.py), the engine's (name, description, kind) tuples are taken as written."""
    from cubeserve.serving import metrics as names

    out = []
    src = ROOT / "cubeserve/serving/triton_metrics.py"
    families = eval(compile(ast.Expression(_families_literal(src, "_FAMILIES")), str(src), "eval"),
                    {"names": names})
    labels_of = _measurement_labels(ast.parse(src.read_text()))  # constant name in metrics.py -> labels
    constant = {getattr(names, c): c for c in dir(names) if c.isupper() and isinstance(getattr(names, c), str)}
    for name, (description, kind, _buckets) in families.items():
        labels = ", ".join(sorted(labels_of.get(constant.get(name, ""), set()) - {"model", "version"}))
        out.append(Metric(name, kind.lower(), description, labels, src.relative_to(ROOT).as_posix()))
    src = ROOT / "cubeserve/serving/triton_engine.py"
    tree = ast.parse(src.read_text())
    reasons = ""
    for node in ast.walk(tree):
        if isinstance(node, ast.comprehension) and isinstance(node.target, ast.Name) and node.target.id == "reason":
            reasons = ", ".join(ast.literal_eval(node.iter))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Tuple) and len(node.elts) == 3 and isinstance(node.elts[0], ast.Constant)
                and str(node.elts[0].value).startswith("cube3d_") and isinstance(node.elts[2], ast.Name)):
            name = node.elts[0].value
            labels = f"reason ({reasons})" if name == "cube3d_requests_dropped_total" else ""
            out.append(Metric(name, node.elts[2].id, node.elts[1].value, labels, src.relative_to(ROOT).as_posix()))
    # The drain's gauge (serving/triton_common.py): one family, its name a constant of drain.py.
    from cubeserve.serving import drain

    src = ROOT / "cubeserve/serving/triton_common.py"
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "MetricFamily":
            kw = {k.arg: k.value for k in node.keywords}
            name = getattr(drain, kw["name"].id)
            kind = kw["kind"].attr.lower()
            out.append(Metric(name, kind, ast.literal_eval(kw["description"]), "instance",
                              src.relative_to(ROOT).as_posix()))
    # A family registered anywhere else would be missing from the reference: say where to add it.
    read = {m.source for m in out}
    for path in sorted((ROOT / "cubeserve").rglob("*.py")):
        if "MetricFamily(" in path.read_text() and path.relative_to(ROOT).as_posix() not in read:
            raise LookupError(f"{path.relative_to(ROOT)} registers a metric family that "
                              "docs/gen/reference.py does not read: add it to metrics()")
    return [with_unit_and_example(m, names.UNIT_AND_EXAMPLE) for m in _checked_documented(out, names.UNIT_AND_EXAMPLE)]


def _checked_documented(found: list[Metric], documented: dict[str, tuple[str, str]]) -> list[Metric]:
    """Every family has its unit and PromQL example in serving/metrics.py's UNIT_AND_EXAMPLE, and
    every entry there is a family: otherwise the docs build (and tests/test_docs.py) fails."""
    registered = {m.name for m in found}
    missing = sorted(m.name for m in found if not all(s.strip() for s in documented.get(m.name, ("", ""))))
    if missing:
        raise LookupError(f"metric families without a unit and a PromQL example in "
                          f"cubeserve/serving/metrics.py's UNIT_AND_EXAMPLE: {', '.join(missing)}")
    stale = sorted(set(documented) - registered)
    if stale:
        raise LookupError(f"cubeserve/serving/metrics.py's UNIT_AND_EXAMPLE names no registered family: "
                          f"{', '.join(stale)}")
    return found


def example_problem(m: Metric) -> str | None:
    """What is wrong with a family's PromQL example for its type, or None: it queries the family
    itself, a counter through rate() or increase(), a histogram's buckets through
    histogram_quantile()."""
    import re

    series = {m.name + "_bucket"} if m.kind == "histogram" else {m.name}
    if not set(re.findall(r"\bcube3d_\w+", m.example)) & series:
        return f"{m.name}: its example does not query {' or '.join(sorted(series))}: {m.example}"
    if m.kind == "counter" and not re.search(rf"\b(rate|increase)\({m.name}\b", m.example):
        return f"{m.name}: a counter's example takes rate() or increase() of it: {m.example}"
    if m.kind == "histogram" and "histogram_quantile(" not in m.example:
        return f"{m.name}: a histogram's example takes histogram_quantile() of its buckets: {m.example}"
    return None


def with_unit_and_example(m: Metric, documented: dict[str, tuple[str, str]]) -> Metric:
    from dataclasses import replace

    out = replace(m, unit=documented[m.name][0], example=documented[m.name][1])
    problem = example_problem(out)
    if problem:
        raise ValueError(f"cubeserve/serving/metrics.py's UNIT_AND_EXAMPLE: {problem}")
    return out


def metric_names() -> set[str]:
    """Every name a query may use: the families, and a histogram's _bucket, _sum and _count."""
    out = set()
    for m in metrics():
        out.add(m.name)
        if m.kind == "histogram":
            out |= {m.name + s for s in ("_bucket", "_sum", "_count")}
    return out


def metrics_intro() -> str:
    """metrics.py's docstring up to its table: the labels every series carries."""
    from cubeserve.serving import metrics

    return metrics.__doc__.split("\n\n")[1]
