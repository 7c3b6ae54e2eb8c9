"""The documentation site (mkdocs.yml, docs/, README.md): it builds with warnings as errors, and
what it tells users to type holds against the code.

* Every command in a shell block is run by a test (RUN_BY: the test file and what in it shows
  that it runs the command) or marked with what it needs that this machine lacks (NEEDS), and
  in both cases checked here as far as this machine can: `cubeserve` and `cube3d-client`
  commands are parsed by their own argparse parsers (a removed or renamed flag, a subcommand or a
  bad value fails), `make` targets and variables must exist in the Makefile, `kubectl` commands
  run against the rendered manifests without a cluster (`--dry-run=client`, `kubectl kustomize`,
  or flags checked against an address nothing listens on), `python -m` modules must exist.
* Every other block names its language and parses; a kustomize patch is applied to an overlay and
  the result validated as tests/test_k8s.py validates the overlays.
* Every flag named in the prose (`--flag` in code) is one the repository's code defines, or one of
  the other tools' listed in OTHER_TOOLS_FLAGS.
* Every metric name the pages mention is one the server registers (docs/gen/reference.py reads
  the registrations), so a renamed metric fails here.
* Every alert links its runbook entry on the published site, and every entry is an alert's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "gen"))
import reference  # noqa: E402

# Where the site is published (mkdocs.yml's site_url): the alerts' runbook_url start with it.
SITE_URL = "https://cube-serve.readthedocs.io/en/latest/"
RUNBOOKS = "operations/runbooks.html"
KUBECTL = str(Path(sys.executable).parent / "kubectl")

# A docs command -> the test file that runs it and a string in that file that shows it does.
# Keys are the command's words up to its options (`cubeserve rollout canary`, `make pipeline`).
RUN_BY = {
    ("make", "test"): ("Makefile", "test: install"),  # what CI runs (.ci/run)
    ("make", "demo"): ("tests/test_docs.py", "test_make_demo_makes_a_mesh_and_its_preview"),
    ("make", "docs"): ("tests/test_docs.py", "mkdocs"),
    ("make", "k8s"): ("tests/test_k8s.py", "kustomize"),
    ("make", "pipeline"): ("tests/test_pipeline.py", "LocalCluster"),
    ("make", "load"): ("tests/test_load.py", "bench"),
    ("make", "serve"): ("tests/test_faults.py", '"serve"'),
    ("make", "gateway"): ("tests/test_gateway.py", '"-m", "cubeserve.cli", "gateway", "--config"'),
    ("make", "control-plane"): (".ci/run", "make cluster-test"),
    ("make", "cluster-test"): (".ci/run", "make cluster-test"),
    ("make", "trace-backend"): ("Makefile", "gateway-e2e-test: install trace-backend"),  # .ci/run's gateway-e2e-test
    ("make", "node"): ("Makefile", "node-test: install node"),  # .ci/run's node-test
    ("make", "node-test"): (".ci/run", "make node-test"),
    ("make", "autoscaling"): ("Makefile", "autoscaling-test: install autoscaling"),  # .ci/run's autoscaling-test
    ("make", "autoscaling-test"): (".ci/run", "make autoscaling-test"),
    ("cubeserve", "weights"): ("tests/test_cli.py", "test_weights_init_and_check"),
    ("cubeserve", "generate"): ("tests/test_cli.py", "test_generate_end_to_end"),
    ("cubeserve", "window-check"): ("tests/test_cli.py", "test_window_check_on_the_demo_model"),
    ("curl",): ("tests/test_clients.py", "test_plain_json_request_gets_valid_json_with_the_mesh_in_base64"),
    ("jq",): ("tests/test_clients.py", "test_plain_json_request_gets_valid_json_with_the_mesh_in_base64"),
    ("cubeserve", "batch"): ("tests/test_batch.py", 'cli.main(["batch"'),
    ("cubeserve", "train"): ("tests/test_demo_model.py", '"train", "all"'),
    ("cubeserve", "gateway"): ("tests/test_gateway.py", '"gateway", "--config"'),
    ("cubeserve", "usage"): ("tests/test_gateway.py", '"usage", "--prometheus"'),
    ("cubeserve", "rollout", "status"): ("tests/test_rollout.py", '"status"'),
    ("cubeserve", "rollout", "canary"): ("tests/test_cluster.py", '"canary", "--version"'),
    ("cubeserve", "rollout", "promote"): ("tests/test_cluster.py", '"promote"'),
    ("cubeserve", "rollout", "rollback"): ("tests/test_cluster.py", '"rollback"'),
    ("cubeserve", "rollout", "ab"): ("tests/test_rollout.py", '"ab"'),
    ("cubeserve", "rollout", "analyze"): ("tests/test_analyze.py", '"rollout", "analyze"'),
    ("cubeserve", "rollout", "version-set"): ("tests/test_rollout.py", '"version-set"'),
    ("cube3d-client",): ("tests/test_clients.py", "project_client"),
    ("kubectl", "apply"): ("tests/test_cluster.py", "--server-side"),
    ("kubectl", "kustomize"): ("tests/test_k8s.py", "kustomize"),
    ("make", "pipelines"): ("tests/test_pipeline.py", "compile_to("),  # kfp_pipelines.compile's
    ("python", "-m", "bench.capacity"): ("tests/test_bench_capacity.py", "capacity.run("),
}
# A docs command no test runs here, and what it needs; it is still checked (module docstring).
NEEDS = {
    ("make", "demo-model"): "19 minutes of training; tests/test_demo_model.py trains at a tiny size",
    ("make", "bench"): "a quiet machine for minutes (benchmarks, not tests)",
    ("make", "image"): "a container registry; tests/test_image.py builds the Dockerfile with podman",
    ("cubeserve", "evaluate"): "minutes on 45 shapes; tests/test_demo_model.py scores the model",
    ("kubectl", "create"): "a cluster (run here with --dry-run=client)",
    ("kubectl", "get"): "a cluster",
    ("kubectl", "annotate"): "a cluster",
    ("kubectl", "wait"): "a cluster",
    ("kubectl", "port-forward"): "a cluster",
    ("docker",): "a container registry",
    ("base64",): "a Secret from a cluster",
}
OTHER_PROGRAMS = {"docker", "base64", "curl", "jq", "openssl"}
# Flags of other tools the prose names: tritonserver, kubectl, pytest-xdist, MLflow's server.
OTHER_TOOLS_FLAGS = {"--model-control-mode", "--http-restricted-api", "--grpc-restricted-protocol",
                     "--exit-timeout-secs", "--server-side", "--dist", "--allowed-hosts", "--help",
                     "--delete-emptydir-data"}
# cube3d_ words that are not metrics: the models, the client package, parameter prefixes.
NOT_METRICS = {"cube3d_stream", "cube3d_client", "cube3d_", "cube3d_shadow"}
LANGUAGES = {"bash", "json", "yaml", "python", "text"}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "gen" not in p.parts)]


def fences():
    """(page, line, language, content) of every fenced block."""
    md = MarkdownIt()
    for page in pages():
        for token in md.parse(page.read_text()):
            if token.type == "fence":
                yield page.relative_to(ROOT).as_posix(), token.map[0] + 1, token.info.split()[0] if token.info else "", token.content


def shell_commands():
    """(where, words) of every command in a shell block: continuation lines joined, comments
    dropped, pipelines and lists split, leading VAR=value assignments dropped, `[...]` (an
    optional part) opened."""
    for page, line, language, content in fences():
        if language != "bash":
            continue
        text = re.sub(r"\\\n\s*", " ", content)
        pending = ""
        for row in text.splitlines():
            pending += row + "\n"
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote spans lines
                continue
            pending = ""
            command: list[str] = []
            optional = False  # inside `[--option VALUE]`
            for word in [*words, "|"]:
                if word in ("|", "||", "&&", ";"):
                    while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", command[0]):
                        command.pop(0)
                    if command:
                        yield f"{page}:{line}", command
                    command = []
                    continue
                if word.startswith("[--"):
                    word, optional = word[1:], True
                if optional and word.endswith("]"):
                    word, optional = word[:-1], False
                command.append(word)
        assert not pending, f"{page}:{line}: a quote that never closes"


def key(words: list[str]) -> tuple[str, ...]:
    """The command's words up to its options, with the program's folder dropped."""
    program = Path(words[0]).name
    if program in ("cubeserve", "cube3d-client"):
        known = reference.commands()
        out = (program,)
        for word in words[1:]:
            if out + (word,) not in known:
                break
            out += (word,)
        return out
    if program == "make":
        return (program, next((w for w in words[1:] if "=" not in w), ""))
    if program in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        return ("python", "-m", words[2])  # the module is the command
    if program in ("kubectl", "python"):
        return (program, words[1])
    return (program,)


def entry(k: tuple[str, ...]):
    matches = [m for m in (*RUN_BY, *NEEDS) if k[:len(m)] == m]
    return max(matches, key=len) if matches else None


COMMANDS = list(shell_commands())


def test_every_docs_command_is_run_by_a_test_or_marked_with_what_it_needs():
    unknown = [f"{where}: {' '.join(words)}" for where, words in COMMANDS if entry(key(words)) is None]
    assert not unknown, "commands neither in RUN_BY (the test that runs it) nor in NEEDS (what it needs that " \
        "a test machine lacks) of tests/test_docs.py:\n" + "\n".join(unknown)
    used = {entry(key(words)) for _, words in COMMANDS}
    assert not set(RUN_BY) - used and not set(NEEDS) - used, "entries no docs command uses: " \
        f"{sorted((set(RUN_BY) | set(NEEDS)) - used)}"
    for k, (path, evidence) in RUN_BY.items():
        if evidence.startswith("test_"):  # a test function by its name
            evidence = f"def {evidence}("
        assert evidence in (ROOT / path).read_text(), f"{' '.join(k)}: {path} does not contain {evidence!r}"


def test_make_demo_makes_a_mesh_and_its_preview(tmp_path):
    """The README's first command: `make demo`'s recipe as the Makefile writes it (the local
    server, the client, a mesh and a PNG, the timings), run with its output in tmp_path."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo: .*\n\t(.+)$", makefile, re.M).group(1)
    prompt = re.search(r"^PROMPT \?= (.+)$", makefile, re.M).group(1)
    words = shlex.split(recipe.replace("$(VENV)", str(Path(sys.executable).parent.parent))
                        .replace("$(PROMPT)", prompt))
    out = tmp_path / "demo.glb"
    words[words.index("--out") + 1] = str(out)
    result = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"prompt: {prompt!r}" in result.stdout and "time per output token" in result.stdout
    assert out.read_bytes()[:4] == b"glTF" and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("where,words", [c for c in COMMANDS if Path(c[1][0]).name in ("cubeserve", "cube3d-client")],
                         ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_cubeserve_commands_parse_with_their_own_parsers(where, words):
    k = key(words)
    parser = reference.commands()[k]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(words[len(k):])
        except SystemExit as exc:
            assert exc.code == 0, f"{where}: {' '.join(words)}\n{err.getvalue()}"


def test_make_targets_and_variables_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for where, words in COMMANDS:
        if words[0] != "make":
            continue
        target = key(words)[1]
        assert target in targets, f"{where}: make {target}"
        for word in words[1:]:
            if "=" in word:
                name = word.split("=", 1)[0]
                assert f"$({name})" in makefile, f"{where}: make {target} {name}=: the Makefile does not use {name}"


def test_kubectl_commands_run_against_the_manifests_without_a_cluster():
    env = {**os.environ, "KUBECONFIG": os.devnull}
    for where, words in COMMANDS:
        if Path(words[0]).name != "kubectl":
            continue
        args = [KUBECTL, *words[1:]]
        if words[1] == "create":  # the object as it would be sent
            result = subprocess.run([*args, "--dry-run=client", "-o", "yaml"], capture_output=True, text=True, env=env)
            assert result.returncode == 0, f"{where}: {' '.join(words)}\n{result.stderr}"
            continue
        if "-k" in words:
            folder = ROOT / words[words.index("-k") + 1]
            result = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True)
            assert result.returncode == 0, f"{where}: {folder}\n{result.stderr}"
        # Flags and verbs are checked before kubectl connects: an address nothing listens on.
        result = subprocess.run([*args, "--server=https://127.0.0.1:1", "--request-timeout=2s"], cwd=ROOT,
                                capture_output=True, text=True, env=env, timeout=60)
        assert not re.search(r"unknown (flag|command|shorthand)|flag needs an argument|error: unknown",
                             result.stderr), f"{where}: {' '.join(words)}\n{result.stderr}"


def test_yaml_patches_apply_to_the_raw_overlay_and_the_result_validates(tmp_path):
    """A kustomize patch the docs show (e.g. Draining's ingress timeouts), applied to
    k8s/overlays/raw as a user would, renders, and every object passes tests/k8s_validation.py
    (KServe's API and the Kubernetes schemas, unknown fields refused)."""
    from k8s_validation import validate

    patches = [(f"{page}:{line}", doc) for page, line, language, content in fences() if language == "yaml"
               for doc in [yaml.safe_load(content)]
               if isinstance(doc, list) and all(isinstance(p, dict) and "patch" in p for p in doc)]
    assert patches, "no kustomize patch in the docs: drop this test or point it at the new one"
    for i, (where, doc) in enumerate(patches):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "kustomization.yaml").write_text(yaml.safe_dump(
            {"resources": [os.path.relpath(ROOT / "k8s" / "overlays" / "raw", folder)], "patches": doc}))
        result = subprocess.run([KUBECTL, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(folder)],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{where}\n{result.stderr}"
        objects = [o for o in yaml.safe_load_all(result.stdout) if o]
        errors = [e for o in objects for e in validate(o)]
        assert not errors, f"{where}: {errors}"
        assert result.stdout != subprocess.run([KUBECTL, "kustomize", str(ROOT / "k8s" / "overlays" / "raw")],
                                               capture_output=True, text=True).stdout, f"{where}: changes nothing"


def test_other_programs_are_known():
    for where, words in COMMANDS:
        program = Path(words[0]).name
        if program in ("cubeserve", "cube3d-client", "make", "kubectl"):
            continue
        if program == "python":
            assert words[1] == "-m" and __import__("importlib.util").util.find_spec(words[2]), f"{where}: {words}"
            continue
        assert program in OTHER_PROGRAMS, f"{where}: {program}: not a program these checks know"


def test_every_block_has_a_language_and_parses():
    from cubeserve.serving import experiment

    for page, line, language, content in fences():
        where = f"{page}:{line}"
        assert language in LANGUAGES, f"{where}: a block's language must be one of {sorted(LANGUAGES)}"
        if language == "json":
            doc = json.loads(content)
            if "arms" in doc or "shadow" in doc:
                assert experiment.parse(content) is not None, where
        elif language == "yaml":
            list(yaml.safe_load_all(content))
        elif language == "python":
            compile(content, where, "exec")


def test_every_page_has_one_title_first():
    """The page's `# Title` (the site's page title), and its sections below it."""
    md = MarkdownIt()
    for page in pages():
        headings = [t.tag for t in md.parse(page.read_text()) if t.type == "heading_open"]
        if page.name == "benchmarks.md" and not headings:  # BENCHMARKS.md included whole
            continue
        assert headings[:1] == ["h1"] and headings.count("h1") == 1, f"{page.relative_to(ROOT)}: {headings[:3]}"


def test_every_flag_the_prose_names_is_defined_by_the_code():
    code = "\n".join(p.read_text() for folder in ("cubeserve", "client", "kfp_pipelines", "bench")
                     for p in (ROOT / folder).rglob("*.py"))
    flags = {flag for parser in reference.commands().values() for a in parser._actions for flag in a.option_strings}
    for page in pages():
        for flag in sorted(set(re.findall(r"`(--[a-z][a-z0-9-]*)", page.read_text()))):
            assert flag in flags or flag in OTHER_TOOLS_FLAGS or f'"{flag}"' in code, \
                f"{page.relative_to(ROOT)}: {flag} is defined by no parser in the code"


def test_every_metric_the_docs_name_is_registered():
    names = reference.metric_names()
    for page in pages():
        for word in sorted(set(re.findall(r"\bcube3d_[a-z_]*", page.read_text()))):
            assert word in names or word in NOT_METRICS, \
                f"{page.relative_to(ROOT)}: {word} is no metric the server registers (docs/gen/reference.py)"


def test_every_metric_has_a_unit_and_a_promql_example_of_its_type():
    """The metrics reference's unit and PromQL example of every family come from
    serving/metrics.py's UNIT_AND_EXAMPLE (reference.metrics() fails the build without them)."""
    found = reference.metrics()
    assert found and all(m.unit and m.example for m in found)
    assert not [problem for m in found if (problem := reference.example_problem(m))]


def test_a_metric_without_a_unit_or_an_example_fails_the_reference(monkeypatch):
    from cubeserve.serving import metrics

    name = metrics.REQUESTS
    monkeypatch.delitem(metrics.UNIT_AND_EXAMPLE, name)
    with pytest.raises(LookupError, match=name):
        reference.metrics()
    monkeypatch.setitem(metrics.UNIT_AND_EXAMPLE, name, ("requests", ""))
    with pytest.raises(LookupError, match=name):
        reference.metrics()
    monkeypatch.setitem(metrics.UNIT_AND_EXAMPLE, name, ("requests", f"sum({name})"))  # a counter, not rated
    with pytest.raises(ValueError, match="rate"):
        reference.metrics()
    monkeypatch.setitem(metrics.UNIT_AND_EXAMPLE, name, ("requests", f"rate({name}[5m])"))
    monkeypatch.setitem(metrics.UNIT_AND_EXAMPLE, "cube3d_renamed_total", ("requests", "x"))  # no such family
    with pytest.raises(LookupError, match="cube3d_renamed_total"):
        reference.metrics()


def test_the_metrics_promql_examples_parse(tmp_path):
    """Each example is valid PromQL: promtool checks them as recording rules."""
    from prometheus_server import require_prometheus

    _, promtool = require_prometheus()
    rules = [{"record": f"docs:example:{i}", "expr": m.example} for i, m in enumerate(reference.metrics())]
    path = tmp_path / "examples.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "metrics-reference", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_metrics_page_keeps_metric_names_whole(built_site):
    """Each name is a `code.metric-name`, which extra.css keeps on one line (no break mid-word),
    with its PromQL example in the row under it."""
    html = (built_site / "reference" / "metrics.html").read_text()
    for m in reference.metrics():
        assert f'<code class="metric-name">{m.name}</code>' in html, m.name
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rule = re.search(r"code\.metric-name \{([^}]*)\}", css)
    assert rule and "white-space: nowrap" in rule[1], "extra.css: code.metric-name must not wrap"


@pytest.mark.parametrize("words,example", list(reference.EXAMPLES.items()), ids=lambda v: " ".join(v)[:60])
def test_every_cli_example_parses_with_its_commands_parser(words, example):
    """The CLI page's example of each command (docs/gen/reference.py's EXAMPLES)."""
    parser = reference.commands()[words]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(shlex.split(example)[len(words):])
        except SystemExit as exc:
            assert exc.code == 0, f"{example}\n{err.getvalue()}"


def test_a_command_without_an_example_fails_the_cli_page(monkeypatch):
    assert reference.examples()
    monkeypatch.delitem(reference.EXAMPLES, ("cubeserve", "rollout", "canary"))
    with pytest.raises(LookupError, match="cubeserve rollout canary"):
        reference.examples()


def test_the_cli_page_shows_shared_options_once_and_every_help_80_columns_wide(built_site):
    """The rollout commands' shared options are listed once, with the commands that take them;
    each command's usage line still names them; every line of a help block fits 80 columns."""
    import html as html_module

    shared = reference.shared_options()
    assert any(("cubeserve", "rollout", "canary") in g.commands and ("--namespace",) in [k[0][-1:] for k in g.keys]
               for g in shared), "the rollout commands' --namespace should be a shared option"
    page = html_module.unescape(re.sub(r"<[^>]+>", "", (built_site / "reference" / "cli.html").read_text()))
    for group in shared:
        for key in group.keys:  # an option's line in an option list (a usage line has it in brackets)
            lines = re.findall(rf"^  {re.escape(key[0][0])}(?=[ ,]|$)", page, re.M)
            assert len(lines) == 1, f"{key[0]}: listed {len(lines)} times on the page, not once"
        for words in group.commands:
            usage = reference.help_text(reference.commands()[words]).split("\n\n")[0]
            assert usage in page, f"{' '.join(words)}: its full usage line"
    for words, parser in reference.commands().items():  # wider only where one usage item is, unbreakable
        wide = [line for line in reference.help_text(parser).splitlines() if len(line) > 80
                and not re.fullmatch(r"\S+|\[[^][]+\]", line.strip())]
        assert not wide, f"{' '.join(words)}: {wide}"


def test_every_plot_has_at_most_six_series_in_colours_of_their_own():
    """docs/gen/plots.py draws bench/results.json with at most plots.MAX_SERIES series a figure
    (check_figure runs on each before it is written), and refuses a figure of more."""
    import plots

    written = {}
    page = plots.draw(written.__setitem__)
    assert len(written) >= 4 and all(f"]({name})" in page for name in written)
    assert plots.MAX_SERIES == 6 and len(set(plots.COLOURS)) == len(set(plots.MARKERS)) == plots.MAX_SERIES
    generated, records = plots.records()
    template = next(r for r in records if r["section"] == "quantization" and r["ms_per_token"])
    crowded = [{**template, "mode": f"mode {i}", "objects_in_flight": n, "device": "crowded"}
               for i in range(plots.MAX_SERIES + 1) for n in (1, 8)]
    with pytest.raises(ValueError, match="split it by subject"):
        plots.draw(lambda name, data: None, (generated, records + crowded))


def alerts() -> dict[str, dict]:
    """Every alert of every PrometheusRule under k8s/."""
    out = {}
    for path in sorted((ROOT / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "PrometheusRule":
                for group in doc["spec"]["groups"]:
                    out.update({r["alert"]: r for r in group["rules"] if "alert" in r})
    return out


def test_every_alert_links_its_runbook_entry_and_every_entry_is_an_alerts():
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert site["site_url"] == SITE_URL
    headings = re.findall(r"^## (\S+)$", (ROOT / "docs" / RUNBOOKS).with_suffix(".md").read_text(), re.M)
    found = alerts()
    assert found and sorted(headings) == sorted(found), "docs/operations/runbooks.md needs one `## AlertName` " \
        f"per alert: missing {sorted(set(found) - set(headings))}, not an alert {sorted(set(headings) - set(found))}"
    for name, rule in found.items():
        annotations = rule["annotations"]
        # One place for the runbook: the page (the annotation `runbook` held text before).
        assert "runbook" not in annotations, name
        assert annotations.get("runbook_url") == f"{SITE_URL}{RUNBOOKS}#{name.lower()}", \
            f"{name}: runbook_url: {SITE_URL}{RUNBOOKS}#{name.lower()}"


def test_the_site_builds_with_warnings_as_errors_and_holds_the_generated_reference(built_site):
    """conftest.py's built_site: `mkdocs build --strict`, a warning fails it."""
    cli = (built_site / "reference" / "cli.html").read_text()
    for words in reference.commands():
        assert " ".join(words) in cli, words
    metrics = (built_site / "reference" / "metrics.html").read_text()
    assert all(m.name in metrics for m in reference.metrics())
    plots_page = (built_site / "performance" / "plots.html").read_text()
    images = re.findall(r'<img [^>]*src="([^"]+\.svg)"', plots_page)
    for plot in ("tokens-per-second-", "latency-vs-concurrency", "numerics-"):
        assert any(i.startswith(plot) for i in images), plot
    for image in images:
        assert (built_site / "performance" / image).stat().st_size > 1000, image
    # BENCHMARKS.md is on the site whole, as pages by subject (docs/gen/benchmarks.py), not copied.
    import benchmarks

    pages = {path: (built_site / path).with_suffix(".html").read_text() for path in benchmarks.pages()}
    headings = re.findall(r"^##+ ([^`\n]+)$", (ROOT / "BENCHMARKS.md").read_text(), re.M)
    assert headings and all(any(h.strip() in page for page in pages.values()) for h in headings)


def test_the_pipeline_page_has_every_parameter_of_the_pipeline(built_site):
    """docs/pipeline.md's parameter table is written at build time from the pipeline function
    (docs/gen/pipeline_params.py): the built page has a row for each of its parameters, with its
    type, and the marker is gone; a page without the marker fails the build."""
    import html

    import pipeline_params

    page = html.unescape((built_site / "pipeline.html").read_text())
    assert pipeline_params.MARKER not in page and "pipeline parameters: generated" not in page
    parameters = pipeline_params.parameters()
    assert len(parameters) > 20 and {"checkpoint", "model_store", "registry_uri"} <= {p["name"] for p in parameters}
    for p in parameters:
        assert re.search(rf"<td><code>{p['name']}</code></td>\s*<td>{p['type']}</td>", page), p["name"]
    with pytest.raises(ValueError, match="must hold the line"):
        pipeline_params.render_page("# A page without the marker\n")


def test_the_benchmarks_summary_copies_its_figures_from_the_sections_it_links():
    """BENCHMARKS.md's Summary: every number of a row's value, and its machine as written, are
    in the section the row links to (a figure re-measured there and not copied fails here)."""
    from markdown.extensions.toc import slugify

    text = (ROOT / "BENCHMARKS.md").read_text()
    sections, heading = {}, None
    for line in text.splitlines():
        if found := re.match(r"^(#{2,3}) (.+)$", line):
            heading = slugify(found[2].replace("`", ""), "-")
            sections[heading] = ""
        elif heading:
            sections[heading] += line + "\n"
    rows = re.findall(r"^\| (.+) \| (.+) \| (.+) \| \[.+\]\(#([a-z0-9_-]+)\) \|$", sections["summary"], re.M)
    assert len(rows) >= 5, sections["summary"]
    for figure, value, machine, anchor in rows:
        section = sections[anchor]  # up to the next ## or ### heading
        assert machine in section, f"{figure}: {machine!r} is not the machine of #{anchor}"
        for number in re.findall(r"\d[\d.]*\d|\d", value):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d]|\.\d)", section), \
                f"{figure}: {number} is not in #{anchor}"
    assert "Not measured yet: anything on a GPU" in sections["summary"]


def test_benchmarks_pages_by_subject_hold_every_section_of_benchmarks_md_as_written():
    """docs/gen/benchmarks.py cuts BENCHMARKS.md into its summary page and a page a subject: each
    `##` section (its `###` ones with it) is on exactly one page, character for character but for
    links to a heading on another page; a section no subject claims fails the build; the
    navigation lists the subject pages as SUBJECTS does."""
    import benchmarks

    text = (ROOT / "BENCHMARKS.md").read_text()
    start, found = benchmarks.sections(text)
    assert start + "".join(body for _, body in found) == text
    pages = benchmarks.split(text)
    assert pages[0].path == "performance/benchmarks.md" and pages[0].text.startswith(start + "## Summary\n")
    for heading, body in found:
        assert sum(body in page.text for page in pages) == 1, heading
    rendered = benchmarks.render(text)
    def unlinked(page: str) -> str:  # links to a heading, as on one page
        return re.sub(r"\]\([a-z./]*#", "](#", page)

    for page in pages:
        assert unlinked(page.text) in unlinked(rendered[page.path]), page.path
    with pytest.raises(LookupError, match="A new subject"):
        benchmarks.split(text + "\n## A new subject\n\n| a |\n|---|\n| 1 |\n")
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    performance = next(entry["Performance"] for entry in site["nav"] if isinstance(entry, dict) and "Performance" in entry)
    by_subject = next(e["Benchmarks by subject"] for e in performance if isinstance(e, dict) and "Benchmarks by subject" in e)
    assert by_subject == [{title: f"{benchmarks.FOLDER}/{name}.md"} for name, title, _, _ in benchmarks.SUBJECTS]


# -- the predict API page: its tables are the code's, its examples run --------------------------------

API_PAGE = ROOT / "docs" / "serving" / "api.md"


def test_the_predict_api_tables_are_what_the_code_renders():
    """The inputs, outputs, TIMINGS keys and parameters of docs/serving/api.md are what
    docs/gen/api_tables.py renders from the code now (requests.py, protocol.py, checks.py, the
    models' config.pbtxt): a changed range, input or parameter fails here until the page is
    rewritten."""
    import difflib

    import api_tables

    text = API_PAGE.read_text()
    rendered = api_tables.render_page(text)
    assert rendered == text, "docs/serving/api.md's tables differ from the code; rewrite them with " \
        "`.venv/bin/python docs/gen/api_tables.py`:\n" + "".join(
            difflib.unified_diff(text.splitlines(True), rendered.splitlines(True), "api.md", "rendered"))


def test_a_changed_range_changes_the_rendered_tables(monkeypatch):
    import api_tables

    from cubeserve import requests

    before = api_tables.inputs_table()
    monkeypatch.setattr(requests, "MAX_RESOLUTION", requests.MAX_RESOLUTION + 1)
    after = api_tables.inputs_table()
    assert f"[4, {requests.MAX_RESOLUTION}]" in after and after != before


def api_examples() -> list[tuple[int, str, str, str]]:
    """(line, language, code, its output) of every example in api.md's "Examples" section: each
    bash or python block and the text block after it, which shows what it prints."""
    tokens = MarkdownIt().parse(API_PAGE.read_text())
    blocks, inside = [], False
    for i, token in enumerate(tokens):
        if token.type == "heading_open" and token.tag == "h2":
            inside = tokens[i + 1].content == "Examples"
        elif inside and token.type == "fence":
            blocks.append((token.map[0] + 1, token.info.split()[0], token.content))
    examples = []
    while blocks:
        (line, language, code), *blocks = blocks
        assert language in ("bash", "python") and blocks and blocks[0][1] == "text", \
            f"docs/serving/api.md:{line}: an example is a bash or python block followed by a text block of its output"
        examples.append((line, language, code, blocks.pop(0)[2]))
    return examples


def numbers_aside(text: str) -> list[str]:
    """Output lines with every number as N: sizes, timings and token ids vary between runs."""
    return [re.sub(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", "N", line.rstrip()) for line in text.strip().splitlines()]


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    """The local server as `make serve` runs it (the demo model), on free ports."""
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, ensure_demo_weights, free_port

    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"))
    ensure_demo_weights(root)
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    with LocalTriton(root, free_port(), free_port(), free_port(), log_path=log) as server:
        yield server


def test_the_predict_api_page_has_its_examples():
    kinds = ("curl", "start_stream", "tritonclient.grpc", "Cube3DClient", "kserve")  # the first that a block has
    found = {(language, next((w for w in kinds if w in code), None)) for _, language, code, _ in api_examples()}
    assert found >= {("bash", "curl"), ("python", "tritonclient.grpc"), ("python", "start_stream"),
                     ("python", "Cube3DClient"), ("python", "kserve")}, found


@pytest.mark.parametrize("line,language,code,output", [pytest.param(*e, id=f"api.md:{e[0]}") for e in api_examples()])
def test_the_predict_api_examples_print_what_the_page_shows(api_server, tmp_path, line, language, code, output):
    """Each example of docs/serving/api.md, run as a user would (bash, or its own Python process:
    kserve's and tritonclient's gRPC modules cannot share one) against a real server, prints what
    the page shows after it, numbers aside."""
    code = code.replace("127.0.0.1:8000", api_server.http_url).replace("127.0.0.1:8001", api_server.grpc_url)
    if language == "bash":
        missing = [p for p in ("curl", "jq", "base64") if p in code and not shutil.which(p)]
        if missing:
            from guards import cannot_run

            cannot_run(f"{', '.join(missing)} not installed")
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"docs/serving/api.md:{line}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert numbers_aside(result.stdout) == numbers_aside(output), f"docs/serving/api.md:{line} printed:\n{result.stdout}"
    for mesh in tmp_path.glob("*.glb"):  # what the examples save is the mesh file
        assert mesh.read_bytes()[:4] == b"glTF", mesh.name
