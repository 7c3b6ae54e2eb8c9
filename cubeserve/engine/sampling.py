"""Guidance and sampling for a whole batch at once, on the device, with no host sync.

Randomness is counter-based: the noise for (seed, step, token id) is a fixed hash, so a
request draws the same tokens alone or batched with others, on any device, and the step
can later run inside a captured CUDA graph (no generator state to carry).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from cubeserve.requests import GenerationRequest

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x < 2**32, in 16-bit halves of c so that no product leaves
    int64 (signed overflow is undefined in the kernels, and CPU and CUDA must agree)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser ("lowbias32") on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, vocab] as a pure function of (seed[b], step[b], token id)."""
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    h = _mix32((seed & _M32) ^ _mix32((seed >> 32) & _M32))
    h = _mix32((h + _mul32(step, 0x9E3779B1)) & _M32)
    h = _mix32((h[:, None] + _mul32(ids, 0x85EBCA77)[None, :]) & _M32)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def guidance_weights(scale: torch.Tensor, step: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The reference's decaying guidance g_i = scale * (N - i) / N, per row."""
    return scale * (num_tokens - step).float() / num_tokens


def apply_guidance(cond: torch.Tensor, uncond: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(1 + g) * cond - g * uncond on fp32 logits [B, V]."""
    g = g[:, None]
    return (1 + g) * cond.float() - g * uncond.float()


def sample(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, step: torch.Tensor, any_sampling: bool = True) -> torch.Tensor:
    """Next token ids [B] from guided fp32 logits [B, V].

    Greedy rows take the argmax. Other rows sample softmax(logits / temperature) restricted to
    the reference's top-p set: tokens are kept while the cumulative probability (including the
    token) is <= p, the most likely token always; p >= 1 keeps everything. `any_sampling=False`
    (the caller knows every row is greedy) skips the sort.
    """
    argmax = logits.argmax(dim=-1)
    if not any_sampling:
        return argmax
    scaled = logits / temperature[:, None]
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(dim=-1) <= top_p[:, None]
    keep[:, 0] = True
    keep |= (top_p >= 1.0)[:, None]
    gumbel = -torch.log(-torch.log(counter_uniform(seed, step, logits.shape[-1])))
    score = torch.log(sorted_probs) + gumbel.gather(-1, order)
    score = score.masked_fill(~keep, float("-inf"))
    sampled = order.gather(-1, score.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where(greedy, argmax, sampled)


@dataclass
class SamplingParams:
    """Per-object guidance scale and sampling parameters as device tensors [B]."""

    scale: torch.Tensor
    greedy: torch.Tensor
    temperature: torch.Tensor  # 1.0 where unset
    top_p: torch.Tensor  # 1.0 (keep everything) where unset
    seed: torch.Tensor

    @classmethod
    def of(cls, requests: list[GenerationRequest], device) -> "SamplingParams":
        return cls(
            scale=torch.tensor([r.guidance_scale for r in requests], dtype=torch.float32, device=device),
            greedy=torch.tensor([r.greedy for r in requests], dtype=torch.bool, device=device),
            temperature=torch.tensor([r.temperature or 1.0 for r in requests], dtype=torch.float32, device=device),
            top_p=torch.tensor([r.top_p if r.top_p is not None else 1.0 for r in requests],
                               dtype=torch.float32, device=device),
            seed=torch.tensor([r.seed for r in requests], dtype=torch.int64, device=device))

    def __getitem__(self, rows) -> "SamplingParams":
        return SamplingParams(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def put(self, rows: list[int], values: "SamplingParams") -> None:
        """Write `values` into `rows` in place (CUDA graphs hold these tensors)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.seed.device)
        for f in fields(self):
            getattr(self, f.name)[index] = getattr(values, f.name)

    def next_tokens(self, cond: torch.Tensor, uncond: torch.Tensor, step: torch.Tensor, num_tokens: int,
                    any_sampling: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Guided logits [B, V] and the next token ids [B] from the cond and uncond rows' logits
        at each object's `step`."""
        guided = apply_guidance(cond, uncond, guidance_weights(self.scale, step, num_tokens))
        return guided, sample(guided, self.greedy, self.temperature, self.top_p, self.seed, step,
                              any_sampling=any_sampling)
