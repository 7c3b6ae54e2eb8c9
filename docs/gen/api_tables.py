"""The reference tables of docs/serving/api.md, rendered from the code that serves the predict API,
so that the page says what a 400 says:

* the inputs and outputs: names, datatypes, shapes and which model takes or returns each, from
  the models' `triton_models/*/config.pbtxt` (what Triton serves, held to
  `cubeserve/serving/protocol.py`'s DATATYPES and INPUTS here); the defaults from
  `GenerationRequest` (`cubeserve/requests.py`) and `ServingOptions` (protocol.py); what is
  accepted, as the message of the 400 a value outside it gets: each input's probe below is run
  through protocol.py's `parse_request` and `validate` (the models' own path), so a changed range
  changes the table;
* the keys of TIMINGS: the engine's `Timings.as_dict()` with every stage set (as the scheduler
  sets them) through protocol.py's `result_outputs`, an empty mesh included;
* the request parameters a client may send and those refused, with the messages of
  `cubeserve/server/checks.py`'s checks.

Only the descriptions ("what it does") are written here, one per name: a name the code gains
without one here fails the rendering. The tables sit in the page between
`<!-- generated: NAME -->` and `<!-- end generated -->`; tests/test_docs.py fails while they
differ from what this renders. After a change, rewrite them:

    .venv/bin/python docs/gen/api_tables.py
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "serving" / "api.md"
sys.path.insert(0, str(ROOT))

from cubeserve import deploy  # noqa: E402
from cubeserve.requests import GenerationRequest, InvalidRequest  # noqa: E402
from cubeserve.server import checks  # noqa: E402
from cubeserve.serving import protocol  # noqa: E402

MODELS = (deploy.PREDICT_MODEL, deploy.STREAM_MODEL)

# -- what each name does (the only hand-written part) -----------------------------------------------

INPUTS = {
    "PROMPT": "The text to generate from, UTF-8. The text encoder reads as much as its context holds.",
    "SEED": "The seed of sampling: the same request and seed give the same tokens on the same device and "
            "numerics. Greedy decoding (TOP_P and TEMPERATURE unset) does not use it.",
    "GUIDANCE_SCALE": "Classifier-free guidance: how strongly the prompt steers each token (the reference's "
                      "schedule: this value at the first token, decaying linearly towards 0 at the last). 0: no "
                      "guidance.",
    "TOP_P": "Nucleus sampling: sample among the most likely tokens while their probabilities add up to at "
             "most this (the most likely one always). Set TOP_P or TEMPERATURE to sample; with both unset, "
             "decoding is greedy (the reference's default). Unset while sampling: 1, every token.",
    "TEMPERATURE": "Sampling temperature (the logits are divided by it). Unset while sampling: 1.",
    "RESOLUTION": "The occupancy grid the mesh is extracted from: 2^RESOLUTION + 1 points a side (8: 257). "
                  "Each step up doubles the side: finer meshes, more geometry time (TIMINGS `geometry_s`).",
    "BBOX": "The object's size x, y, z, for models trained with a bounding box (v0.5-style) only: scaled so "
            "that the longest side is 1.925, so only the proportions count.",
    "FORMAT": "The mesh file's format: `glb` (binary glTF) or `obj` (Wavefront OBJ, text).",
    "MESH_ENCODING": "How MESH carries the file: `base64` text, which a JSON response can hold (every client), "
                     "or `binary`, the file's bytes (gRPC, or REST with the binary tensor extension).",
    "STREAM_PROGRESS": "With `true`, a response with PROGRESS after every decode step, before the mesh.",
}

OUTPUTS = {
    "MESH": "The mesh file in FORMAT, encoded as MESH_ENCODING says. A shape with no surface at this "
            "resolution is a file with no faces (NUM_FACES 0), and TIMINGS says why (`message`).",
    "SHAPE_TOKENS": "The shape tokens generated, one per decode step: N is the model's token count (32 for the "
                    "demo model).",
    "NUM_VERTICES": "The mesh's vertices.",
    "NUM_FACES": "The mesh's triangles.",
    "TIMINGS": "A JSON object: seconds per stage, the keys in the table below.",
    "MODEL_VERSION": "The model version that served the request, which is the checkpoint version (`\"7\"`).",
    "ARM": "The experiment arm that served the request, `\"\"` outside an experiment "
           "([Experiments in one server](experiments.md)).",
    "PROGRESS": "Tokens generated so far: alone in each progress response (STREAM_PROGRESS), and in the final "
                "response with the mesh.",
}

TIMINGS = {
    "queue_s": "From the engine's receipt of the request to its admission into a decode slot, the admission "
               "(`prefill_s`) included.",
    "prefill_s": "The admission: the text encoder and the prefill of the batch it joined.",
    "tokens_s": "Decoding: from the admission to the last token.",
    "time_per_token_s": "`tokens_s` divided by the tokens (one decode step each).",
    "geometry_s": "Tokens to mesh: the shape decoder, the occupancy grid and marching cubes.",
    "total_s": "From the engine's receipt of the request to the mesh: the server's part of the latency "
               "(the transfers and the predict model's forwarding excluded).",
    "export_s": "The mesh to its file (FORMAT), in MESH_ENCODING, after `total_s`.",
    "message": "Only when the mesh is empty: why (e.g. the occupancy field does not cross zero at this "
               "resolution).",
}

PARAMETERS = {
    "timeout": "Microseconds: past it the request is dropped, waiting or decoding, and fails with 503 "
               "(`unavailable: deadline exceeded: ...`). See Deadlines below.",
    "priority": "Triton's request priority. Accepted; these models configure no priority levels, so it "
                "changes no order.",
    "binary_data_output": "The binary tensor extension (REST): every output as binary data after the JSON.",
    "triton_enable_empty_final_response": "A stream client's: an empty response flagged final ends each "
                                          "request's responses (tritonclient's `enable_empty_final_response`).",
    "x-cube3d-user": "An experiment's user key: the same key, the same arm. Also a header (gRPC metadata).",
    "x-cube3d-arm": "Pins an experiment's arm by name. Also a header (gRPC metadata).",
    "binary_data_size": "The binary tensor extension (REST): the size of this input's binary data.",
    "binary_data": "The binary tensor extension (REST): this output as binary data.",
}

# Each input's probes: (values of the inputs beside PROMPT, whether the model takes BBOX), each
# a request the models refuse with a 400 naming the input. None: the input has no check of its
# own beyond its datatype's (the front ends').
PROBES = {
    "PROMPT": [({"PROMPT": "x" * 1_000_000}, True), ({"PROMPT": b"\xff"}, True)],
    "SEED": [({"SEED": -1}, True)],
    "GUIDANCE_SCALE": [({"GUIDANCE_SCALE": -1.0}, True)],
    "TOP_P": [({"TOP_P": -1.0}, True)],
    "TEMPERATURE": [({"TEMPERATURE": -1.0}, True)],
    "RESOLUTION": [({"RESOLUTION": -1}, True)],
    "BBOX": [({"BBOX": [1.0, -1.0, 1.0]}, True), ({"BBOX": [1.0, 1.0, 1.0]}, False)],
    "FORMAT": [({"FORMAT": "?"}, True)],
    "MESH_ENCODING": [({"MESH_ENCODING": "?"}, True)],
    "STREAM_PROGRESS": None,
}

# -- read from the code ---------------------------------------------------------------------------

_NUMPY = {"BYTES": np.object_, "INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}


def served_tensors() -> dict[str, dict[str, tuple[str, list[int], bool]]]:
    """{"input"|"output": {name: (datatype, dims, optional, models)}} from both models' config.pbtxt,
    in the predict model's order then the stream model's additions."""
    out: dict[str, dict] = {"input": {}, "output": {}}
    for model in MODELS:
        text = (ROOT / "triton_models" / model / "config.pbtxt").read_text()
        for kind in out:
            block = re.search(rf"^{kind} \[(.*?)^\]", text, re.M | re.S).group(1)
            for name, dtype, dims, optional in re.findall(
                    r'\{ name: "(\w+)" data_type: TYPE_(\w+) dims: \[ ([^\]]*) \]( optional: true)? \}', block):
                datatype = "BYTES" if dtype == "STRING" else dtype
                entry = (datatype, [int(d) for d in dims.split(",")], bool(optional))
                if name in out[kind] and out[kind][name][:3] != entry:
                    raise ValueError(f"{name}: the two models declare it differently")
                out[kind].setdefault(name, (*entry, []))[3].append(model)
    for kind, names in out.items():
        for name, (datatype, dims, _, _) in names.items():
            if protocol.DATATYPES.get(name) != datatype:
                raise ValueError(f"{name}: config.pbtxt says {datatype}, protocol.DATATYPES {protocol.DATATYPES.get(name)}")
            if kind == "input" and dims != [protocol.INPUTS[name][2]]:
                raise ValueError(f"{name}: config.pbtxt dims {dims}, protocol.INPUTS {protocol.INPUTS[name][2]}")
    if list(out["input"]) != list(protocol.INPUTS) or set(out["output"]) != set(protocol.OUTPUTS):
        raise ValueError("the models' config.pbtxt and protocol.INPUTS / OUTPUTS name different tensors")
    return out


def _tensor(name: str, value) -> np.ndarray:
    dtype = _NUMPY[protocol.DATATYPES[name]]
    values = value if isinstance(value, list) else [value]
    if dtype is np.object_:
        return np.array([v if isinstance(v, bytes) else v.encode() for v in values], dtype=np.object_)
    return np.array(values, dtype=dtype)


def refusal(values: dict, uses_bbox: bool) -> str:
    """The 400 message the models give a request with `values`, as protocol.py makes it."""
    arrays = {"PROMPT": _tensor("PROMPT", "a ball")}
    arrays.update({name: _tensor(name, value) for name, value in values.items()})
    try:
        request, _ = protocol.parse_request(arrays)
        protocol.validate(request, uses_bbox)
    except InvalidRequest as exc:
        return str(exc)
    raise ValueError(f"{values} (bbox {uses_bbox}) is accepted: this probe no longer finds the input's limit")


def _without_value(message: str) -> str:
    """A refusal without the value it quotes (", got ...") and without the name it starts with."""
    return re.sub(r", got .*$", "", message.split(": ", 1)[1])


def accepted(name: str) -> str:
    probes = PROBES[name]
    if probes is None:  # the datatype's own check, the front ends'
        try:
            checks.element_check(protocol.DATATYPES[name], name)(None, name)
        except checks.Refused as exc:
            return f"`{_without_value(str(exc))}`"
        raise ValueError(name)
    found = []
    for values, uses_bbox in probes:
        message = refusal(values, uses_bbox)
        if not message.startswith(f"{name}: "):
            raise ValueError(f"the probe of {name} was refused for another input: {message}")
        found.append(f"`{_without_value(message)}`")
    return "; ".join(found)


def default(name: str) -> str:
    field_name = protocol.INPUTS[name][0]
    if field_name is None:
        attribute = {"MESH_ENCODING": "mesh_encoding", "STREAM_PROGRESS": "stream_progress"}[name]
        value = getattr(protocol.ServingOptions(), attribute)
    else:
        [value] = [f.default for f in fields(GenerationRequest) if f.name == field_name]
        assert value is not MISSING
    if value is None:
        return "unset"
    return f"`{json.dumps(value)}`"


def timings_keys() -> list[str]:
    """The keys of TIMINGS as the server sends them: every stage the engine's Timings holds set (as
    the scheduler sets them), through protocol.result_outputs, for an empty mesh (which adds its
    message) and a mesh with faces."""
    from cubeserve.engine.engine import GenerationResult, Timings
    from cubeserve.engine.geometry import Mesh

    stages = Timings(**{f.name: 1 for f in fields(Timings)})
    keys: list[str] = []
    for mesh in (Mesh(np.zeros((3, 3), np.float32), np.array([[0, 1, 2]])), Mesh(message="why")):
        result = GenerationResult(GenerationRequest("a ball"), [1], mesh, stages)
        outputs = protocol.result_outputs(result, "base64", "1")
        keys += [k for k in json.loads(bytes(outputs["TIMINGS"][0])) if k not in keys]
    return keys


def _models(models: list[str]) -> str:
    return "both" if len(models) == len(MODELS) else ", ".join(f"`{m}` only" for m in models)


def _shape(dims: list[int]) -> str:
    return "[" + ", ".join("N" if d < 0 else str(d) for d in dims) + "]"


def _described(table: dict, name: str, what: str) -> str:
    if name not in table:
        raise KeyError(f"docs/gen/api_tables.py: describe {what} {name!r} in {what.upper()}")
    return table[name]


# -- the tables -------------------------------------------------------------------------------------

def inputs_table() -> str:
    rows = ["| input | datatype | shape | default | accepted: the 400 otherwise | models | what it does |",
            "|---|---|---|---|---|---|---|"]
    for name, (datatype, dims, optional, models) in served_tensors()["input"].items():
        rows.append(f"| `{name}` | {datatype} | {_shape(dims)} | {default(name) if optional else '**required**'} | "
                    f"{accepted(name)} | {_models(models)} | {_described(INPUTS, name, 'inputs')} |")
    return "\n".join(rows)


def outputs_table() -> str:
    rows = ["| output | datatype | shape | models | what it holds |", "|---|---|---|---|---|"]
    for name in protocol.OUTPUTS:
        datatype, dims, _, models = served_tensors()["output"][name]
        rows.append(f"| `{name}` | {datatype} | {_shape(dims)} | {_models(models)} | "
                    f"{_described(OUTPUTS, name, 'outputs')} |")
    return "\n".join(rows)


def timings_table() -> str:
    rows = ["| TIMINGS key | what it holds |", "|---|---|"]
    rows += [f"| `{key}` | {_described(TIMINGS, key, 'timings')} |" for key in timings_keys()]
    return "\n".join(rows)


def _check_messages(check) -> str:
    """What `check` (a checks.py value check) accepts, as its refusals say it."""
    found = []
    for value in (None, "x" * (checks.MAX_STRING_BYTES + 1)):
        try:
            check(value, "where")
        except checks.Refused as exc:
            message = f"`{_without_value(str(exc))}`"
            if message not in found:
                found.append(message)
    return "; ".join(found)


def parameters_table() -> str:
    rows = ["| parameter | where | accepted: the 400 otherwise | what it does |", "|---|---|---|---|"]
    for where, allowed in (("the request's `parameters`", checks.REQUEST_PARAMETERS),
                           ("an input's `parameters`", checks.INPUT_PARAMETERS),
                           ("an output's `parameters`", checks.OUTPUT_PARAMETERS)):
        for name, check in allowed.items():
            rows.append(f"| `{name}` | {where} | {_check_messages(check)} | "
                        f"{_described(PARAMETERS, name, 'parameters')} |")
    return "\n".join(rows)


def refused_table() -> str:
    rows = ["| parameter | the 400's reason |", "|---|---|"]
    rows += [f"| `{name}` | {reason} |" for name, reason in checks.REFUSED_PARAMETERS.items()]
    return "\n".join(rows)


TABLES = {"inputs": inputs_table, "outputs": outputs_table, "timings": timings_table,
          "parameters": parameters_table, "refused-parameters": refused_table}
_BLOCK = re.compile(r"(<!-- generated: ([\w-]+) .*?-->\n)(.*?)(<!-- end generated -->)", re.S)


def render_page(text: str) -> str:
    """`text` (the page) with every generated block rendered anew; ValueError for a block this
    module does not know, or a table the page lacks."""
    seen = []

    def block(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise ValueError(f"docs/serving/api.md: no table {name!r} (known: {', '.join(TABLES)})")
        seen.append(name)
        return f"{match.group(1)}{TABLES[name]()}\n{match.group(4)}"

    out = _BLOCK.sub(block, text)
    missing = set(TABLES) - set(seen)
    if missing:
        raise ValueError(f"docs/serving/api.md lacks the generated tables {sorted(missing)}")
    return out


def main() -> int:
    text = PAGE.read_text()
    new = render_page(text)
    if new != text:
        PAGE.write_text(new)
        print(f"rewrote the generated tables of {PAGE.relative_to(ROOT)}")
    else:
        print(f"{PAGE.relative_to(ROOT)}: the generated tables are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
