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
    from cubeserve.server.local_triton import free_port

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


def _window_rows(stdout: str) -> dict[int, list[str]]:
    """`cubeserve window-check`'s table: its cells by window, the header checked."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["window"])
    assert lines[start].split() == ["window", "tokens/forward", "forwards/object", "identical", "to", "1",
                                    "decode", "ms/object", "speed-up"]
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("recommendation:"):
            break
        cells = line.split()
        rows[int(cells[0])] = cells[1:]
    return rows


def test_window_check_on_the_demo_model(tmp_path):
    """The docs' command on the shipped demo model: window 1 keeps exactly one token a forward and
    32 forwards an object; float32 greedy windows give window 1's tokens for every object in
    fewer forwards; the recommendation is the fastest window, or window 1 within the margin."""
    from cubeserve.engine.window_check import MARGIN

    report = tmp_path / "window-check.json"
    proc = run_cli("window-check", "--weights", str(ROOT / "models" / "demo"), "--dtype", "float32",
                   "--prompts", "4", "--windows", "4,16", "--cpu-threads", "1", "--json", str(report))
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("weights: ") and "(config demo, 32 tokens an object)" in lines[0]
    assert lines[1].startswith("device: cpu, float32; ") and "ISA: " in lines[1] and lines[1].endswith("; PyTorch threads: 1")
    assert lines[2] == "decoding: greedy, guidance 3, 4 prompts, 1 in flight, windows 1,4,16"
    rows = _window_rows(proc.stdout)
    assert sorted(rows) == [1, 4, 16]
    assert rows[1][:3] == ["1.00", "32.0", "4/4"] and rows[1][-1] == "1.00x"
    for w in (4, 16):
        assert rows[w][2:4] == ["4/4", "(100%)"] and float(rows[w][0]) > 1.2 and float(rows[w][1]) < 32
    figures = json.loads(report.read_text())
    assert [f["window"] for f in figures["windows"]] == [1, 4, 16] and figures["dtype"] == "float32"
    assert figures["windows"][0]["tokens_per_forward"] == 1.0
    assert all(f["identical_share"] == 1.0 for f in figures["windows"])
    best = min(figures["windows"], key=lambda f: f["wall_s_per_object"])
    chosen = figures["recommendation"]["decode_window"]
    assert lines[-1] == figures["recommendation"]["line"]
    if best["wall_vs_window_1"] <= 1 - MARGIN:
        assert chosen == best["window"] and lines[-1].startswith(
            f'recommendation: set "decode_window": {chosen} in the version\'s version.json (window {chosen}: ')
    else:
        assert chosen == 1 and lines[-1].startswith("recommendation: leave decode_window at 1 (")


def test_window_check_samples_top_p_from_a_prompts_file(tiny_weights, tmp_path, capsys):
    """Random weights, top-p with a seed per prompt, two objects in flight (the last group of one):
    window decoding is lossless for sampled tokens too."""
    from cubeserve import cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red chair\n\n  a round table  \na lamp\n")
    rc = cli.main(["window-check", "--weights", str(tiny_weights), "--dtype", "float32", "--prompts-file",
                   str(prompts), "--top-p", "0.9", "--seed", "5", "--windows", "8,4", "--in-flight", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "decoding: top-p 0.9, seeds 5..7, guidance 3, 3 prompts, 2 in flight, windows 1,4,8" in out
    rows = _window_rows(out)
    assert rows[1][:3] == ["1.00", "32.0", "3/3"]
    assert all(rows[w][2:4] == ["3/3", "(100%)"] for w in (4, 8))
    assert out.splitlines()[-1].startswith("recommendation: ")


def test_window_check_recommends_a_window_only_past_the_margin():
    from cubeserve.engine.window_check import MARGIN, WindowFigures, recommend

    def figures(*walls):
        out = [WindowFigures(w, 1, 32, [1], [32 // w], [wall], [wall / 32], 1) for w, wall in zip((1, 4, 8), walls)]
        for f in out:
            f.base_wall_s = walls[0]
        return out

    assert recommend(figures(1.0, 0.99, 1 - MARGIN / 2)).window == 1
    line = recommend(figures(1.0, 0.99, 1 - MARGIN / 2)).line
    assert line.startswith("recommendation: leave decode_window at 1 (the fastest, window 8, took 0.97x")
    assert recommend(figures(1.0, 1.2, 1.1)).line == \
        "recommendation: leave decode_window at 1 (window 1 had the best decode wall clock)"
    chosen = recommend(figures(1.0, 0.8, 0.9))
    assert chosen.window == 4 and chosen.line == ('recommendation: set "decode_window": 4 in the version\'s '
                                                  'version.json (window 4: 1.25x window 1\'s decode speed per object)')


@pytest.mark.parametrize("args,error", [
    (["--windows", "1,0"], "error: --windows: each window must be an integer in 1..64 (1: one token per forward), "
                           "comma-separated, got '0'"),
    (["--windows", "65"], "error: --windows: each window must be an integer in 1..64"),
    (["--windows", "4,x"], "error: --windows: each window must be an integer in 1..64"),
    (["--prompts", "0"], "error: --prompts: must be an integer of at least 1, got 0"),
    (["--in-flight", "0"], "error: --in-flight: must be an integer of at least 1, got 0"),
    (["--top-p", "1.5"], "error: --top-p: must be a number in (0, 1], got 1.5"),
    (["--guidance", "-1"], "error: --guidance: must be a number in [0, 100], got -1.0"),
    (["--weights", "{tmp}/nowhere"], "error: --weights {tmp}/nowhere: no such directory"),
    (["--prompts-file", "{tmp}/empty.txt"], "error: --prompts-file {tmp}/empty.txt: holds no prompt; give at "
                                            "least 1, one prompt per line"),
    (["--prompts-file", "{tmp}/missing.txt"], "error: --prompts-file {tmp}/missing.txt: no such file"),
])
def test_window_check_bad_arguments_are_one_line_naming_the_option(tiny_weights, tmp_path, capsys, args, error):
    from cubeserve import cli

    (tmp_path / "empty.txt").write_text("\n  \n")
    args = [a.format(tmp=tmp_path) for a in args]
    weights = [] if "--weights" in args else ["--weights", str(tiny_weights)]
    assert cli.main(["window-check", *weights, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(error.format(tmp=tmp_path)), line
