"""The parameter table of docs/pipeline.md, written at build time (a mkdocs-gen-files script,
mkdocs.yml) from the checkpoint pipeline itself: `kfp_pipelines/checkpoint_rollout.py`'s pipeline
function as KFP compiles it, which is what the Kubeflow UI's run form shows (each parameter's
name, type, default and the description KFP takes from the function's docstring). The page holds
only the marker MARKER where the table goes; a page without it fails the build, so the table
cannot go missing or disagree with the code. `python docs/gen/pipeline_params.py` prints it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- pipeline parameters: generated at build time by docs/gen/pipeline_params.py -->"
# Any image name does: it changes the steps' containers, not the parameters.
_IMAGE = "docs.invalid/cube-serve:docs"
# KFP's parameter types (the compiled component's inputs, as the UI's run form names them), in
# users' words.
_TYPES = {"String": "text", "Integer": "integer", "Float": "number", "Boolean": "true or false",
          "List": "JSON list", "Dict": "JSON object"}


def parameters() -> list[dict]:
    """[{name, type, default (None: required), description}] in the function's order."""
    sys.path.insert(0, str(ROOT))
    from kfp_pipelines.checkpoint_rollout import build

    out = []
    for name, given in build(_IMAGE).component_spec.inputs.items():
        out.append({"name": name, "type": _TYPES.get(given.type, given.type),
                    "default": given.default if given.optional else None,
                    "description": given.description or ""})
    return out


def _cell(text: str) -> str:
    """Table-safe: no column breaks, and `<model_store>` shown as text, not taken for an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _default(value) -> str:
    if value is None:
        return "**required**"
    if value == "":
        return "empty"
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def table() -> str:
    rows = ["| parameter | type | default | what it does |", "|---|---|---|---|"]
    for p in parameters():
        rows.append(f"| `{p['name']}` | {p['type']} | {_default(p['default'])} | {_cell(p['description'])} |")
    return "\n".join(rows) + "\n"


def render_page(text: str) -> str:
    """The page with the table in place of its marker (ValueError without exactly one)."""
    if text.count(MARKER) != 1:
        raise ValueError(f"docs/pipeline.md must hold the line {MARKER!r} once, where the parameter table goes")
    return text.replace(MARKER, table().rstrip("\n"))


def write_page() -> None:
    """At build time: the site's pipeline.md is the page with its table (the edit link stays the page's)."""
    import mkdocs_gen_files

    with mkdocs_gen_files.open("pipeline.md", "r") as f:
        text = f.read()
    with mkdocs_gen_files.open("pipeline.md", "w") as f:
        f.write(render_page(text))
    mkdocs_gen_files.set_edit_path("pipeline.md", "pipeline.md")


if __name__ == "__main__":  # print the table
    print(table())
elif __name__ == "<run_path>":  # mkdocs-gen-files runs its scripts (mkdocs.yml) with runpy.run_path
    write_page()
