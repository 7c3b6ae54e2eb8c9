"""CLIP text conditioning through `transformers`, from a local directory only.

The directory is laid out as `openai/clip-vit-large-patch14` (a full CLIP or a text-only
model, plus its tokenizer files). Nothing is fetched from a model hub: a missing directory
is an error that says what to put there. `build_tiny_clip` writes a small, deterministic
CLIP text model and byte-level tokenizer in the same layout for tests and the demo.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

# Never reach for a hub at run time, whatever the caller's environment says.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings and progress bars off for a load (restored after)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class TextEncoder:
    """Prompts -> CLIP last_hidden_state [B, max_length, hidden] in fp32."""

    def __init__(self, clip_dir: str | Path, device: torch.device | str = "cpu"):
        from transformers import AutoTokenizer, CLIPTextModel

        clip_dir = Path(clip_dir)
        if not (clip_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{clip_dir}: no CLIP text model here (expected config.json, model weights and "
                "tokenizer files, as in openai/clip-vit-large-patch14)"
            )
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(clip_dir), local_files_only=True)
        with _quiet_transformers():
            self.model, info = CLIPTextModel.from_pretrained(
                str(clip_dir), local_files_only=True, use_safetensors=True, dtype=torch.float32,
                output_loading_info=True)
        # A full CLIP checkpoint also holds the vision tower and the projections, which the text
        # model does not use (transformers' load report calls them unexpected: not news). A
        # missing weight would be random: that is an error.
        if info.get("missing_keys"):
            raise ValueError(f"{clip_dir}: the CLIP text model lacks weights {sorted(info['missing_keys'])[:5]}")
        self.model = self.model.to(self.device).eval()
        self.max_length = int(self.tokenizer.model_max_length)
        self.hidden_size = int(self.model.config.hidden_size)

    def token_count(self, prompt: str) -> int:
        """CLIP tokens of `prompt` including BOS/EOS, before truncation."""
        return len(self.tokenizer(prompt)["input_ids"])

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> torch.Tensor:
        batch = self.tokenizer(
            prompts, max_length=self.max_length, padding="max_length", truncation=True,
            return_tensors="pt",
        )
        batch = {k: v.to(self.device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        # The reference runs CLIP in fp32 and uses every position (no padding mask downstream).
        return self.model(**batch).last_hidden_state.float()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tiny_clip(out_dir: str | Path, hidden_size: int, seed: int = 0, max_length: int = 77) -> Path:
    """Write a small CLIP text model with a byte-level BPE tokenizer (no merges) to out_dir."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizerFast
    import inspect

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    vocab_tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(vocab_tokens)}
    (out_dir / "vocab.json").write_text(json.dumps(vocab))
    (out_dir / "merges.txt").write_text("#version: 0.2\n")
    if "vocab" in inspect.signature(CLIPTokenizerFast.__init__).parameters:  # transformers >= 5
        tokenizer = CLIPTokenizerFast(vocab=vocab, merges=[], model_max_length=max_length,
                                      pad_token="<|endoftext|>")
    else:
        tokenizer = CLIPTokenizerFast(
            vocab_file=str(out_dir / "vocab.json"), merges_file=str(out_dir / "merges.txt"),
            model_max_length=max_length, pad_token="<|endoftext|>",
        )
    tokenizer.save_pretrained(str(out_dir))

    config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=max_length,
        bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    model = CLIPTextModel(config).eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
