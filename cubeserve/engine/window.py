"""Window (Jacobi) decoding: several positions of an object in one forward, losslessly.

A slot at position p knows its next input (BOS or the token chosen at p - 1) and carries
guesses g_0 .. g_{T-2} for the tokens at p .. p + T - 2. One forward runs the T inputs
[known, g_0, .., g_{T-2}] at positions p .. p + T - 1 and chooses a token c_j at every position
exactly as a one-token step would there (guidance with position p + j's weight, the sampler's
noise of (seed, p + j)): a token is a pure function of the logits before it and its position,
never of how many forwards it took. c_0 is the sequential token (its inputs are all known);
c_j is too while every guess before it equalled the token chosen before it, since then its
inputs are the sequential ones. So `accepted` keeps c_0 and each next token while the guess
that fed it matched, and the slot advances by that many positions (1 .. T). The rest is
discarded; their cache entries sit at positions the next window starts at and overwrites
before any query reads them (a query reads only positions up to its own).

The next guesses are the window's own choices at the positions it did not accept (the Jacobi
iteration: a guess becomes right once the tokens before it are), then its last choice repeated.
"""

from __future__ import annotations

import torch


def accepted(guesses: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """How many of `chosen` [B, T] (the window's tokens) sequential decoding gives, per row, 1..T:
    the first, then each next one while the guess [B, T - 1] that was its input matched the
    token chosen before it."""
    match = guesses == chosen[:, :-1]
    return 1 + match.long().cumprod(dim=1).sum(dim=1)


def next_guesses(chosen: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Guesses [B, T - 1] for the next window, which starts `accepted` positions further:
    this window's choices at those positions, then its last choice repeated."""
    t = chosen.shape[1]
    index = (accepted[:, None] + torch.arange(t - 1, device=chosen.device)).clamp(max=t - 1)
    return chosen.gather(1, index)
