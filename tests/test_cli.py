"""The `cubeserve` command as a user runs it."""

import io
import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh

from cubeserve.engine import GenerationRequest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "cubeserve.cli", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"cubeserve {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.mark.parametrize("config,expected", [
    ("v0.1", (1793525376, 272986273, 931551744)),
    ("v0.5", (1793531520, 273772705, 931551744)),
])
def test_info_json(config, expected):
    info = json.loads(run_cli("info", "--config", config, "--json").stdout)
    assert (info["gpt_parameters"], info["tokenizer_parameters"], info["decode_parameters"]) == expected


def test_generate_end_to_end(tiny_weights, make_engine, tmp_path):
    out, tokens_file = tmp_path / "chair.glb", tmp_path / "tokens.json"
    proc = run_cli("generate", "a red chair", "--weights", str(tiny_weights), "--out", str(out), "--resolution", "5",
                   "--seed", "4", "--top-p", "0.9", "--device", "cpu", "--dtype", "float32", "--save-tokens", str(tokens_file),
                   "--preview", str(tmp_path / "chair.png"), "--decode-window", "4")
    assert "time per output token" in proc.stdout and "geometry" in proc.stdout
    mesh = trimesh.load(io.BytesIO(out.read_bytes()), file_type="glb", force="mesh")
    assert len(mesh.faces) > 0
    assert (tmp_path / "chair.png").read_bytes().startswith(b"\x89PNG")
    tokens = json.loads(tokens_file.read_text())
    expected = make_engine("tiny").generate_tokens([GenerationRequest("a red chair", seed=4, top_p=0.9)])[0]
    assert torch.equal(torch.tensor(tokens), expected)


def test_generate_obj_with_bbox(tiny_bbox_weights, make_engine, tmp_path):
    """The OBJ holds the mesh of the tokens the box conditioned: the in-process engine's
    vertices and faces, in the grid's bounds. (For this prompt the box changes the tokens.)"""
    out, tokens_file = tmp_path / "box.obj", tmp_path / "tokens.json"
    run_cli("generate", "a red chair", "--weights", str(tiny_bbox_weights), "--out", str(out), "--resolution", "4",
            "--bbox", "1,2,0.5", "--single-block", "causal", "--device", "cpu", "--dtype", "float32",
            "--save-tokens", str(tokens_file))
    engine = make_engine("tiny-bbox", "causal")
    tokens = engine.generate_tokens([GenerationRequest("a red chair", bbox=(1, 2, 0.5))])
    assert json.loads(tokens_file.read_text()) == tokens[0].tolist()
    assert not torch.equal(tokens, engine.generate_tokens([GenerationRequest("a red chair")]))
    expected = engine.tokens_to_meshes(tokens, [4])[0]

    text = out.read_text()
    records = [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert set(records) == {"v", "f"}, set(records)  # geometry only
    assert records.count("v") == len(expected.vertices) > 0 and records.count("f") == len(expected.faces) > 0
    mesh = trimesh.load(io.StringIO(text), file_type="obj", process=False, force="mesh")
    assert np.array_equal(mesh.faces, expected.faces)
    np.testing.assert_allclose(mesh.vertices, expected.vertices, rtol=0, atol=1e-5)
    assert np.abs(mesh.vertices).max() <= 1.05


def test_bad_values_exit_with_a_message_naming_the_field(tiny_weights, tmp_path):
    proc = run_cli("generate", "x", "--weights", str(tiny_weights), "--out", str(tmp_path / "x.glb"),
                   "--top-p", "1.5", "--device", "cpu", check=False)
    assert proc.returncode == 2 and "top_p: must be a number in (0, 1]" in proc.stderr
    proc = run_cli("generate", "x", "--weights", str(tiny_weights), "--decode-window", "0", check=False)
    assert proc.returncode == 2 and "decode_window: must be an integer in 1..64" in proc.stderr
    proc = run_cli("generate", "x", "--weights", str(tmp_path / "nowhere"), check=False)
    assert proc.returncode == 2 and "not a directory" in proc.stderr


def test_weights_init_and_check(tmp_path):
    run_cli("weights", "init", "--config", "tiny-bbox", "--seed", "3", "--out", str(tmp_path / "w"))
    proc = run_cli("weights", "check", str(tmp_path / "w"))
    assert "valid tiny-bbox checkpoint (48 shape tokens, bbox=True)" in proc.stdout
    assert (tmp_path / "w" / "clip" / "tokenizer.json").is_file()


def test_serve_on_a_port_in_use_names_the_port_and_its_flag_in_one_line(tmp_path):
    """`cubeserve serve` (and `make serve`) where something listens on its port already: one line
    naming the port and the flag that moves it, exit 2, nothing started, no traceback."""
    from cubeserve.serving.local_triton import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("serve", "--model-repository", str(tmp_path), "--http-port", str(port),
                       "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--timeout", "30",
                       check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()
    assert line == (f"error: port in use on 127.0.0.1: {port} (REST: change it with --http-port, or make serve "
                    "PORT=...); stop what listens there (another `cubeserve serve`?) or choose another port")
    assert not list(tmp_path.iterdir())  # not even the demo weights were copied


def test_make_serve_passes_its_port_variables_to_cubeserve_serve():
    from cubeserve.cli import build_parser

    def recipe(*variables):
        out = subprocess.run(["make", "-s", "-n", "serve", *variables], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        [line] = [row for row in out.splitlines() if "cubeserve serve" in row]
        words = shlex.split(line)
        return build_parser().parse_args(words[words.index("serve"):])

    args = recipe("PORT=8100", "GRPC_PORT=8101", "METRICS_PORT=8102")
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8100, 8101, 8102)
    args = recipe()
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8000, 8001, 8002)
