"""The demo model: the trainer's determinism and resumption, the shipped checkpoint's loading
and its held-out quality, and the Triton demo serving it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cubeserve.checkpoint import validate_dir
from cubeserve.config import DEMO, TINY
from cubeserve.demo import build, shapes, train
from cubeserve.demo.data import ShapeSet
from cubeserve.demo.evaluate import evaluate_dir
from cubeserve.server.local_triton import DEMO_MODEL, ensure_demo_weights

FAST_TOKENIZER = train.TokenizerTraining(steps=4, batch=2, encoder_points=64, queries=64, save_every=2,
                                         warmup=2, restart_every=1, continuous_fraction=0.5)
FAST_GPT = train.GPTTraining(steps=4, batch=2, save_every=2, warmup=2)


@pytest.fixture(scope="module")
def small_set() -> ShapeSet:
    return ShapeSet.build(shapes.sample_shapes(4, seed=0), seed=0)


def _state(module: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dataset_cache_is_reused_only_for_the_same_shapes(tmp_path, small_set, monkeypatch):
    shape_list = shapes.sample_shapes(4, seed=0)
    built = ShapeSet.load_or_build(tmp_path / "d.pt", shape_list, seed=0)
    assert torch.equal(built.surface, small_set.surface) and built.prompts == small_set.prompts
    real_build = ShapeSet.build

    def no_build(*a, **k):
        raise AssertionError("rebuilt although cached")
    monkeypatch.setattr(ShapeSet, "build", no_build)
    assert torch.equal(ShapeSet.load_or_build(tmp_path / "d.pt", shape_list, seed=0).labels, built.labels)
    # The same prompts with other parameters (a changed shape definition) are sampled again.
    moved = [shapes.build_shape(s.name, shapes.variants(s.name)[0], s.params["size_level"], s.prompt,
                                {k: v for k, v in shapes.variants(s.name)[0].params.items()}, 0.5)
             for s in shape_list]
    with pytest.raises(AssertionError, match="rebuilt"):
        ShapeSet.load_or_build(tmp_path / "d.pt", moved, seed=0)
    monkeypatch.setattr(ShapeSet, "build", real_build)
    assert ShapeSet.load_or_build(tmp_path / "d.pt", moved, seed=0).prompts == built.prompts


QUIET = dict(show_progress=False, log=lambda _: None)


def _train_tokenizer(work_dir: Path, data: ShapeSet, seed: int = 3, **kw):
    work_dir.mkdir(exist_ok=True)
    return train.train_tokenizer(TINY, data, work_dir, FAST_TOKENIZER, seed=seed, **QUIET, **kw)


def test_tokenizer_training_is_deterministic_and_resumes_to_the_same_weights(tmp_path, small_set):
    straight = _state(_train_tokenizer(tmp_path / "a", small_set))
    assert _same(straight, _state(_train_tokenizer(tmp_path / "b", small_set)))
    assert not _same(straight, _state(_train_tokenizer(tmp_path / "c", small_set, seed=4)))
    # Interrupted after 2 of 4 steps (the state file says so), then resumed by a fresh call.
    _train_tokenizer(tmp_path / "d", small_set, stop_at=2)
    assert torch.load(tmp_path / "d" / train.TOKENIZER_STATE, weights_only=True)["step"] == 2
    assert _same(straight, _state(_train_tokenizer(tmp_path / "d", small_set)))
    # A state from another recipe is refused by path, not continued or overwritten.
    other = train.TokenizerTraining(**{**FAST_TOKENIZER.__dict__, "lr": 5e-4})
    with pytest.raises(ValueError, match="another config, settings, seed or dataset"):
        train.train_tokenizer(TINY, small_set, tmp_path / "d", other, seed=3, **QUIET)
    # The VQ half ran: the trained tokenizer's codes decode, and training moved the weights.
    assert not _same(straight, _state(train.init_tokenizer(TINY, 3, FAST_TOKENIZER.max_frequency)))


def test_gpt_training_is_deterministic_and_resumes_to_the_same_weights(tmp_path, small_set):
    tok = _train_tokenizer(tmp_path / "tok", small_set)
    text = build.text_encoder(TINY, tmp_path / "tok", seed=0)

    def run(name, **kw):
        (tmp_path / name).mkdir(exist_ok=True)
        return _state(train.train_gpt(TINY, tok, text, small_set, tmp_path / name, FAST_GPT, seed=5, **QUIET, **kw))

    straight = run("a")
    assert _same(straight, run("b"))
    run("c", stop_at=3)
    assert _same(straight, run("c"))
    # The exported GPT carries the embedding rows the loader writes (shape_proj of the codebook).
    gpt = train.init_gpt(TINY, 0)
    gpt.load_state_dict(straight)
    rows = straight["transformer.wte.weight"][: TINY.gpt.shape_model_vocab_size]
    gpt.set_codebook_embeddings(tok.bottleneck.block.normalized_codebook())
    assert torch.allclose(rows, gpt.transformer.wte.weight[: len(rows)])


def test_gpt_loss_teaches_the_serving_engine(tmp_path, small_set):
    """What the training forward predicts at each position is what the cached engine computes
    for the same prefix: a model trained on one sequence generates that sequence."""
    from cubeserve.checkpoint import CLIP_DIR, save_checkpoint
    from cubeserve.engine import Engine, GenerationRequest

    tok = _train_tokenizer(tmp_path / "tok", small_set)
    text = build.text_encoder(TINY, tmp_path / "tok", seed=0)
    target = torch.randint(TINY.gpt.shape_model_vocab_size, (1, TINY.num_tokens), generator=torch.Generator().manual_seed(0))
    codebook = tok.bottleneck.block.normalized_codebook().detach()
    gpt = train.init_gpt(TINY, 0)
    opt = torch.optim.Adam(gpt.parameters(), lr=3e-3)
    hidden = text(["a cube"])
    for _ in range(150):
        loss = train.gpt_loss(gpt, codebook, hidden, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    gpt.eval()
    gpt.set_codebook_embeddings(codebook)
    out = save_checkpoint(TINY, gpt, tok, tmp_path / "ckpt")
    shutil.copytree(tmp_path / "tok" / CLIP_DIR, out / CLIP_DIR)
    engine = Engine.from_dir(out)
    tokens = engine.generate_tokens([GenerationRequest(prompt="a cube", guidance_scale=0.0)])
    assert tokens[0].tolist() == target[0].tolist()


# -- the shipped checkpoint ---------------------------------------------------------------------

def test_demo_checkpoint_loads_strictly_as_the_demo_config():
    cfg, gpt_header, tok_header = validate_dir(DEMO_MODEL)
    assert cfg == DEMO
    assert all(info.dtype == "F32" for info in gpt_header.values())
    card = (DEMO_MODEL / build.CARD_FILE).read_text()
    assert "held-out" in card and "| **mean** |" in card


def test_demo_checkpoint_meets_its_held_out_targets():
    """The card's claims, measured again: generation IoU >= 0.7 against the shape each held-out
    prompt was written from, tokenizer reconstruction IoU >= 0.85, every class recognisable."""
    recorded = json.loads((DEMO_MODEL / build.EVALUATION_FILE).read_text())
    evaluation = evaluate_dir(DEMO_MODEL, n=len(recorded["scores"]), resolution=recorded["resolution"])
    summary = evaluation.summary
    assert summary["generation_iou"] >= 0.7, evaluation.markdown_table()
    assert summary["reconstruction_iou"] >= 0.85, evaluation.markdown_table()
    assert min(v["generation_iou"] for v in evaluation.per_class.values()) >= 0.4, evaluation.markdown_table()
    # Same machine or not, the recorded figures are what this code measures.
    for key in ("generation_iou", "reconstruction_iou"):
        assert summary[key] == pytest.approx(recorded["summary"][key], abs=0.02)


def test_local_server_gets_the_demo_model(tmp_path):
    repo = tmp_path / "repo"
    (repo / "cube3d_stream" / "1").mkdir(parents=True)
    (repo / "cube3d_stream" / "config.pbtxt").write_text("")
    written = ensure_demo_weights(repo)
    assert written == repo / "cube3d_stream" / "1" / "weights"
    assert validate_dir(written)[0] == DEMO
    # Weights a user put there are never replaced.
    assert ensure_demo_weights(repo) == repo / "cube3d_stream"


def test_pipeline_gate_can_require_the_shape_benchmark(tiny_weights):
    from cubeserve.pipeline.steps import GateFailed, evaluate_checkpoint, gate

    thresholds = dict(min_valid_share=0.0, min_watertight_share=0.0, min_token_agreement=0.0,
                      max_time_per_output_token_s=10.0)
    demo = evaluate_checkpoint(str(DEMO_MODEL), ["a cube"], resolution=5, heldout_shapes=9)["metrics"]
    noise = evaluate_checkpoint(str(tiny_weights), ["a cube"], resolution=5, heldout_shapes=9)["metrics"]
    assert demo["shape_iou"] > 0.6 > noise["shape_iou"] >= 0.0
    assert demo["shape_reconstruction_iou"] > 0.7
    assert gate(demo, **thresholds, min_shape_iou=0.6).startswith("gate passed")
    with pytest.raises(GateFailed, match=r"shape_iou 0\.\d+ < 0\.6"):
        gate(noise, **thresholds, min_shape_iou=0.6)
    unmeasured = evaluate_checkpoint(str(tiny_weights), ["a cube"], resolution=5)["metrics"]
    assert unmeasured["shape_iou"] == -1.0
    with pytest.raises(GateFailed, match="not measured"):
        gate(unmeasured, **thresholds, min_shape_iou=0.6)
    assert gate(unmeasured, **thresholds).startswith("gate passed")  # no threshold, no benchmark needed


def test_train_command_writes_a_checkpoint_with_its_card(tmp_path):
    """`cubeserve train all` end to end at a toy size: a strict-loading checkpoint, the card and
    the evaluation it reports; `cubeserve evaluate` scores the result again."""
    from cubeserve.cli import main

    out = tmp_path / "model"
    args = ["train", "all", "--config", "tiny", "--shapes", "9", "--tokenizer-steps", "3", "--gpt-steps", "2",
            "--work-dir", str(tmp_path / "work"), "--out", str(out), "--eval-shapes", "9", "--no-progress"]
    assert main(args) == 0
    assert validate_dir(out)[0] == TINY
    recorded = json.loads((out / build.EVALUATION_FILE).read_text())
    assert len(recorded["scores"]) == 9 and recorded["training"]["tokenizer"]["steps"] == 3
    card = (out / build.CARD_FILE).read_text()
    assert "NOT met" in card  # three steps teach nothing, and the card says so
    assert (tmp_path / "work" / train.TOKENIZER_STATE).is_file() and (tmp_path / "work" / train.GPT_STATE).is_file()


def test_train_command_refuses_bad_sizes_by_name(tmp_path, capsys):
    from cubeserve.cli import main

    assert main(["train", "all", "--shapes", "-1", "--work-dir", str(tmp_path)]) == 2
    assert "--shapes must be at least 1, got -1" in capsys.readouterr().err
    assert main(["train", "gpt", "--work-dir", str(tmp_path / "empty")]) == 2
    assert "run `cubeserve train tokenizer` first" in capsys.readouterr().err
