"""The full-size models match the reference: parameter counts and every tensor name/shape."""

from pathlib import Path

import pytest

from cubeserve.checkpoint import build_models, describe, parameter_counts
from cubeserve.config import PRESETS, V0_1, V0_5, get_config, read_yaml, write_yaml
from cubeserve.model.tokenizer import PointEmbedder

DATA = Path(__file__).parent / "data"


def reference_tensors(version: str) -> dict[str, dict[str, tuple]]:
    """{file: {name: shape}} from the reference's state-dict listing."""
    out, current = {}, None
    for line in (DATA / f"cube3d-{version}-tensors.tsv").read_text().splitlines():
        if line.startswith("#"):
            current = out.setdefault(line.split()[1].rstrip(":"), {})
            continue
        name, shape = line.split("\t")[:2]
        current[name] = tuple(int(v) for v in shape.strip("()").split(",") if v.strip())
    return out


@pytest.mark.parametrize("cfg,gpt,tok,decode", [
    (V0_1, 1793525376, 272986273, 931551744),
    (V0_5, 1793531520, 273772705, 931551744),
])
def test_parameter_counts_match_reference(cfg, gpt, tok, decode):
    assert parameter_counts(cfg) == {"gpt_parameters": gpt, "tokenizer_parameters": tok, "decode_parameters": decode}


@pytest.mark.parametrize("cfg", [V0_1, V0_5], ids=["v0.1", "v0.5"])
def test_state_dict_names_and_shapes_match_reference(cfg):
    ref = reference_tensors(cfg.name)
    gpt, tok = build_models(cfg, "meta")
    for module, file in ((gpt, "shape_gpt.safetensors"), (tok, "shape_tokenizer.safetensors")):
        ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert ours == ref[file]


def test_reference_config_values():
    g, t = V0_1.gpt, V0_1.tokenizer
    assert (g.n_layer, g.n_single_layer, g.n_head, g.n_embd, g.head_dim) == (23, 1, 12, 1536, 128)
    assert g.rope_theta == 10000.0 and g.eps == 1e-6 and g.vocab_size == 16387
    assert (g.bos_id, g.eos_id, g.pad_id) == (16384, 16385, 16386)
    assert (t.width, t.num_heads, t.num_encoder_layers, t.num_decoder_layers) == (768, 12, 13, 24)
    assert t.encoder_cross_attention_levels == (0, 2, 4, 8) and PointEmbedder(t.num_freqs).out_dim == 771
    assert (V0_1.num_tokens, V0_1.cond_len) == (512, 77)
    assert (V0_5.num_tokens, V0_5.cond_len, V0_5.gpt.use_bbox) == (1024, 78, True)


def test_describe_reports_decode_bytes():
    info = describe(V0_1)
    assert info["decode_bytes_bf16"] == 2 * 931551744


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_round_trip(tmp_path, name):
    path = tmp_path / "open_model.yaml"
    write_yaml(PRESETS[name], path)
    assert read_yaml(path) == PRESETS[name]


def test_reference_style_yaml_is_read(tmp_path):
    # As the reference spells it: extra keys, "1e-6" read as a string by YAML 1.1, lists.
    path = tmp_path / "open_model.yaml"
    path.write_text(
        "gpt_model:\n  checkpoint_path: ''\n  n_layer: 23\n  n_single_layer: 1\n  rope_theta: 10000\n"
        "  n_head: 12\n  n_embd: 1536\n  bias: true\n  eps: 1e-6\n  shape_model_vocab_size: 16384\n"
        "  text_model_embed_dim: 768\n  use_pooled_text_embed: False\n  shape_model_embed_dim: 32\n"
        "  encoder_with_cls_token: true\n"
        "shape_model:\n  encoder_with_cls_token: true\n  num_encoder_latents: 512\n  num_decoder_latents: 0\n"
        "  embed_dim: 32\n  width: 768\n  num_heads: 12\n  out_dim: 1\n  eps: 1e-6\n  num_freqs: 128\n"
        "  point_feats: 3\n  embed_point_feats: false\n  num_encoder_layers: 13\n"
        "  encoder_cross_attention_levels: [0, 2, 4, 8]\n  num_decoder_layers: 24\n  num_codes: 16384\n"
        "text_model_pretrained_model_name_or_path: openai/clip-vit-large-patch14\n"
    )
    cfg = get_config(path)
    assert cfg.gpt == V0_1.gpt and cfg.tokenizer == V0_1.tokenizer


def test_unknown_config_names_the_choices():
    with pytest.raises(ValueError, match="v0.1"):
        get_config("v0.9")


def test_a_model_conditioned_on_the_pooled_clip_embedding_is_refused(tmp_path):
    """The reference's use_pooled_text_embed: true conditions on one pooled token; the engine
    reads CLIP's hidden states only, so it must not serve such a model as if it were one."""
    path = tmp_path / "open_model.yaml"
    write_yaml(V0_1, path)
    path.write_text(path.read_text().replace("gpt_model:\n", "gpt_model:\n  use_pooled_text_embed: true\n", 1))
    with pytest.raises(ValueError, match="use_pooled_text_embed: true is not supported"):
        read_yaml(path)


def test_a_full_clip_checkpoint_loads_quietly_and_a_missing_weight_is_an_error(tmp_path, capfd):
    """A CLIP checkpoint with more than the text model (here its text projection, as
    openai/clip-vit-large-patch14 has, with the vision tower) loads without transformers' load
    report or progress bar, and encodes as the text model alone; a lacking weight is refused."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from cubeserve.model.text import TextEncoder, build_tiny_clip

    plain = build_tiny_clip(tmp_path / "plain", hidden_size=32)
    full = tmp_path / "full"
    shutil.copytree(plain, full)
    with_projection = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(plain))
    state = load_file(plain / "model.safetensors")
    with_projection.load_state_dict(state, strict=False)
    save_file({**state, "text_projection.weight": with_projection.text_projection.weight.detach().clone()},
              str(full / "model.safetensors"), metadata={"format": "pt"})
    capfd.readouterr()
    encoded = TextEncoder(full)(["a red chair"])
    out, err = capfd.readouterr()
    assert "UNEXPECTED" not in out + err and "LOAD REPORT" not in out + err and "Loading weights" not in err
    assert torch.equal(encoded, TextEncoder(plain)(["a red chair"]))
    broken = tmp_path / "broken"
    shutil.copytree(plain, broken)
    missing = next(k for k in state if k.endswith("final_layer_norm.weight"))
    save_file({k: v for k, v in state.items() if k != missing}, str(broken / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="the CLIP text model lacks weights"):
        TextEncoder(broken)
