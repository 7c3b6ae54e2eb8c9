"""Loading is strict, safetensors-only, version-aware, and fails whole with a clear message."""

import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cubeserve.checkpoint import (
    GPT_FILE, TOKENIZER_FILE, CheckpointError, load_models, sha256_file, validate_dir, write_random_weights,
)
from cubeserve.engine import Engine


@pytest.fixture
def weights_copy(tiny_weights, tmp_path):
    dst = tmp_path / "w"
    shutil.copytree(tiny_weights, dst)
    return dst


def _rewrite(path, change):
    state = load_file(str(path))
    change(state)
    save_file(state, str(path))


def test_weights_init_is_deterministic(tiny_weights, tmp_path):
    again = write_random_weights("tiny", tmp_path / "again", seed=0)
    other = write_random_weights("tiny", tmp_path / "other", seed=1)
    for name in (GPT_FILE, TOKENIZER_FILE):
        assert sha256_file(again / name) == sha256_file(tiny_weights / name)
        assert sha256_file(other / name) != sha256_file(tiny_weights / name)


def test_loaded_weights_equal_the_files_and_wte_holds_the_codebook(tiny_weights):
    cfg, gpt, tok = load_models(tiny_weights)
    on_disk = load_file(str(tiny_weights / TOKENIZER_FILE))
    assert torch.equal(tok.encoder.embedder.weight, on_disk["embedder.weight"])  # the shared alias
    assert tok.occupancy_decoder.embedder is tok.embedder
    codebook = tok.bottleneck.block.normalized_codebook()
    expected = codebook @ gpt.shape_proj.weight.T + gpt.shape_proj.bias
    assert torch.allclose(gpt.transformer.wte.weight[: cfg.tokenizer.num_codes], expected, atol=1e-6)


def test_missing_file_is_named(weights_copy):
    (weights_copy / TOKENIZER_FILE).unlink()
    with pytest.raises(CheckpointError, match=TOKENIZER_FILE):
        Engine.from_dir(weights_copy)


def test_missing_tensor_is_named(weights_copy):
    _rewrite(weights_copy / GPT_FILE, lambda s: s.pop("transformer.dual_blocks.1.post_1.c_proj.bias"))
    with pytest.raises(CheckpointError, match=r"shape_gpt.safetensors: missing tensors .*dual_blocks\.1\.post_1\.c_proj\.bias"):
        load_models(weights_copy)


def test_unexpected_tensor_is_named(weights_copy):
    _rewrite(weights_copy / TOKENIZER_FILE, lambda s: s.__setitem__("decoder.extra", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"shape_tokenizer.safetensors: unexpected tensors \['decoder.extra'\]"):
        load_models(weights_copy)


def test_misshapen_tensor_is_named(weights_copy):
    _rewrite(weights_copy / GPT_FILE, lambda s: s.__setitem__("lm_head.weight", torch.zeros(3, 4)))
    with pytest.raises(CheckpointError, match=r"tensor lm_head.weight has shape \[3, 4\], expected \[67, 64\]"):
        load_models(weights_copy)


def test_pickled_files_are_never_loaded(weights_copy):
    state = load_file(str(weights_copy / GPT_FILE))
    (weights_copy / GPT_FILE).unlink()
    torch.save(state, weights_copy / GPT_FILE)  # a pickle behind a safetensors name
    with pytest.raises(CheckpointError, match=f"{GPT_FILE}: this is a pickled"):
        load_models(weights_copy)


def test_extra_pickle_file_in_directory_is_refused(weights_copy):
    (weights_copy / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="pytorch_model.bin: pickled weights files are never loaded"):
        load_models(weights_copy)


def test_truncated_file_is_named(weights_copy):
    (weights_copy / TOKENIZER_FILE).write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match=f"{TOKENIZER_FILE}: not a safetensors file"):
        load_models(weights_copy)


def test_a_file_whose_tensor_data_is_cut_short_is_refused_before_loading(weights_copy):
    """The header is intact, the tensors' bytes are not all there (an interrupted copy)."""
    path = weights_copy / TOKENIZER_FILE
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=f"{TOKENIZER_FILE}: truncated or padded"):
        validate_dir(weights_copy)


def test_version_mismatch_is_detected_from_the_tensors(tiny_bbox_weights):
    # v0.5-style weights (bbox_proj, more shape tokens) with a v0.1-style config: the user trap.
    with pytest.raises(CheckpointError, match=r"weights are v0.5-style \(bbox_proj present\), 48 shape tokens.*config 'tiny'"):
        load_models(tiny_bbox_weights, config="tiny")
    cfg, _, _ = validate_dir(tiny_bbox_weights)
    assert cfg.gpt.use_bbox and cfg.num_tokens == 48


def test_missing_clip_directory_says_what_to_put_there(weights_copy):
    shutil.rmtree(weights_copy / "clip")
    with pytest.raises(FileNotFoundError, match="clip-vit-large-patch14"):
        Engine.from_dir(weights_copy)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "training_args.pkl"])
def test_a_pickle_inside_the_clip_directory_is_refused(weights_copy, name):
    """The CLIP folder is read by transformers; a pickle there fails the whole directory before
    anything is loaded, as one beside the safetensors files does."""
    (weights_copy / "clip" / name).write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match=f"clip/{name}: pickled weights files are never loaded"):
        validate_dir(weights_copy)
    with pytest.raises(CheckpointError, match=f"clip/{name}"):
        Engine.from_dir(weights_copy)


def test_a_pickle_behind_the_clip_safetensors_name_is_refused(weights_copy):
    state = load_file(str(weights_copy / "clip" / "model.safetensors"))
    (weights_copy / "clip" / "model.safetensors").unlink()  # the state maps the old file
    torch.save(state, weights_copy / "clip" / "model.safetensors")
    with pytest.raises(CheckpointError, match="clip/model.safetensors: this is a pickled PyTorch file"):
        Engine.from_dir(weights_copy)


def _identity_vq_config():
    """Tiny, with the shape tokenizer's width equal to its code dimension."""
    import dataclasses

    from cubeserve.config import TINY

    tok = dataclasses.replace(TINY.tokenizer, width=TINY.tokenizer.embed_dim)
    return dataclasses.replace(TINY, name="tiny-identity-vq", tokenizer=tok)


def test_width_equal_to_the_code_dimension_has_identity_projections(tmp_path):
    """The reference's spherical VQ has no c_in / c_x / c_out when the shape model's width equals
    its embed_dim (they are nn.Identity): such a checkpoint loads, and the codes go to the
    decoder unprojected."""
    from cubeserve.checkpoint import read_safetensors_header
    from cubeserve.engine import GenerationRequest

    cfg = _identity_vq_config()
    weights = write_random_weights(cfg, tmp_path / "w", seed=2)
    header = read_safetensors_header(weights / TOKENIZER_FILE)
    assert not [n for n in header if n.startswith("bottleneck.block.c_")]
    assert "bottleneck.block.codebook.weight" in header
    assert validate_dir(weights)[0] == cfg

    engine = Engine.from_dir(weights)
    vq = engine.tokenizer.bottleneck.block
    ids = torch.randint(0, cfg.tokenizer.num_codes, (2, cfg.num_tokens), generator=torch.Generator().manual_seed(0))
    assert torch.equal(vq.lookup(ids), vq.normalized_codebook()[ids])
    assert torch.equal(engine.tokenizer.decode_tokens(ids), engine.tokenizer.decoder(vq.normalized_codebook()[ids]))
    # The whole path runs (random weights this narrow need not enclose a surface).
    assert len(engine.generate([GenerationRequest("a red chair", resolution=4)])[0].tokens) == cfg.num_tokens


def test_width_unlike_the_code_dimension_still_needs_the_projections(weights_copy):
    _rewrite(weights_copy / TOKENIZER_FILE, lambda s: s.pop("bottleneck.block.c_out.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['bottleneck.block.c_out.weight'\]"):
        load_models(weights_copy)
