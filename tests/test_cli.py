"""The `cubeserve` command as a user runs it."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import trimesh

from cubeserve.engine import GenerationRequest


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
                   "--preview", str(tmp_path / "chair.png"))
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
    proc = run_cli("generate", "x", "--weights", str(tmp_path / "nowhere"), check=False)
    assert proc.returncode == 2 and "not a directory" in proc.stderr


def test_weights_init_and_check(tmp_path):
    run_cli("weights", "init", "--config", "tiny-bbox", "--seed", "3", "--out", str(tmp_path / "w"))
    proc = run_cli("weights", "check", str(tmp_path / "w"))
    assert "valid tiny-bbox checkpoint (48 shape tokens, bbox=True)" in proc.stdout
    assert (tmp_path / "w" / "clip" / "tokenizer.json").is_file()
