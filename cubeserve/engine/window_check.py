"""Window decoding measured on a checkpoint: tokens accepted per forward and decode wall clock
per object at several windows, side by side in one run, and the window worth setting.

`cubeserve window-check` runs it on a user's own weights; `bench.parallel_decode` runs the same
functions on the demo model and the tiny configs. Prompts are decoded in groups of `in_flight`
objects admitted together (a group finishes at the forward of its slowest object), and every
group runs every window in turn (the order rotating from group to group), so a change of the
machine's load, or of its clock, falls on every window alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cubeserve.config import DECODE_WINDOW_SETTING, check_decode_window
from cubeserve.engine.runner import DecodeRunner
from cubeserve.requests import GenerationRequest

DEFAULT_WINDOWS = (1, 4, 8, 16)
DEFAULT_PROMPTS = 32
# A window is recommended only when its decode wall clock per object is below window 1's by at
# least this share: smaller differences are within what a shared machine's noise moves.
MARGIN = 0.05


@dataclass
class WindowFigures:
    """One window's measurements over all groups of one run."""

    window: int
    in_flight: int
    tokens: int  # an object's tokens
    group_sizes: list[int]
    forwards: list[int]  # per group
    seconds: list[float]  # per group: admission (CLIP, prefill) to its last token
    forward_seconds: list[float]  # per group: its forwards' time (admission excluded) over their number
    identical: int  # objects whose tokens equal the reference's (window 1's, or those given)
    base_wall_s: float = float("nan")  # window 1's wall_s_per_object in the same run

    @property
    def objects(self) -> int:
        return sum(self.group_sizes)

    @property
    def forwards_per_object(self) -> float:
        """Forwards an object takes part in (its group's), the mean over objects."""
        return sum(f * g for f, g in zip(self.forwards, self.group_sizes)) / self.objects

    @property
    def tokens_per_forward(self) -> float:
        """Tokens an object gets per forward it takes part in, over all objects."""
        return self.tokens / self.forwards_per_object

    @property
    def forwards_per_group(self) -> float:
        return statistics.mean(self.forwards)

    @property
    def wall_s_per_object(self) -> float:
        """Decode wall clock of all groups over all objects (the mean: objects differ widely in forwards)."""
        return sum(self.seconds) / self.objects

    @property
    def forward_s_median(self) -> float:
        """The time of one forward, the median over groups (a shared machine's descheduling makes outliers)."""
        return statistics.median(self.forward_seconds)

    @property
    def identical_share(self) -> float:
        return self.identical / self.objects

    @property
    def wall_vs_window_1(self) -> float:
        return self.wall_s_per_object / self.base_wall_s

    @property
    def speedup(self) -> float:
        """Window 1's decode wall clock per object over this window's."""
        return self.base_wall_s / self.wall_s_per_object

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("forward_seconds", "base_wall_s")}
        out.update(objects=self.objects, tokens_per_forward=self.tokens_per_forward,
                   forwards_per_object=self.forwards_per_object, forwards_per_group=self.forwards_per_group,
                   identical_share=self.identical_share, wall_s_per_object=self.wall_s_per_object,
                   forward_s_median=self.forward_s_median, wall_vs_window_1=self.wall_vs_window_1,
                   speedup=self.speedup)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(runner: DecodeRunner, requests: list[GenerationRequest]) -> tuple[torch.Tensor, int, float, float]:
    """`requests` admitted together into `runner` and decoded: their tokens [B, N], the forwards
    taken, the seconds from admission to the last token and those of the forwards alone."""
    forwards = runner.forwards
    t0 = time.perf_counter()
    slots = runner.admit(requests)
    _sync(runner.device)
    t1 = time.perf_counter()
    while any(runner.generated[s] < runner.num_tokens for s in slots):
        runner.step()
    _sync(runner.device)  # CUDA: the host runs up to MAX_STEPS_IN_FLIGHT steps ahead of the GPU
    t2 = time.perf_counter()
    tokens = torch.stack([runner.tokens_of(s) for s in slots])
    for s in slots:
        runner.release(s)
    return tokens, runner.forwards - forwards, t2 - t0, t2 - t1


def windows_of(windows) -> tuple[int, ...]:
    """The windows to measure, each checked (1..64), ascending, window 1 always among them."""
    return tuple(sorted({1, *(check_decode_window(w) for w in windows)}))


def measure(engine, requests: list[GenerationRequest], windows, in_flight: int = 1,
            reference: torch.Tensor | None = None, graphs: bool | None = None,
            progress=None) -> list[WindowFigures]:
    """Every window of `windows` (window 1 added) on `requests` decoded by `engine` in groups of
    `in_flight` objects, every group running every window in turn (module docstring), after one
    warm-up group per window. `reference` [len(requests), N]: the tokens the identical share
    compares with (default: window 1's of the same group). `graphs`: window 1 replays CUDA graphs
    as the server's scheduler does (default: on CUDA); wider windows always run eagerly.
    `progress(done, groups)` after each group. Returns one WindowFigures per window, ascending."""
    from cubeserve.engine.scheduler import GRAPH_BUCKETS

    windows = windows_of(windows)
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    engine.validate(requests)
    if graphs is None:
        graphs = engine.device.type == "cuda"
    runners = {w: engine.decode_runner(max_objects=in_flight, window=w,
                                       graph_buckets=GRAPH_BUCKETS if graphs and w == 1 else None)
               for w in windows}
    groups = [list(range(i, min(i + in_flight, len(requests)))) for i in range(0, len(requests), in_flight)]
    for w in windows:  # warm-up: first-use costs (allocations, kernel choices) counted for none
        decode(runners[w], requests[:in_flight])
    n = engine.cfg.num_tokens
    figures = {w: WindowFigures(w, in_flight, n, [len(g) for g in groups], [], [], [], 0) for w in windows}
    for g, group in enumerate(groups):
        batch = [requests[i] for i in group]
        order = windows[g % len(windows):] + windows[:g % len(windows)]
        tokens = {}
        for w in order:
            tokens[w], forwards, seconds, stepping = decode(runners[w], batch)
            figures[w].forwards.append(forwards)
            figures[w].seconds.append(seconds)
            figures[w].forward_seconds.append(stepping / forwards)
        expected = reference[group] if reference is not None else tokens[1]
        for w in windows:
            figures[w].identical += sum(torch.equal(t, e) for t, e in zip(tokens[w], expected))
        if progress is not None:
            progress(g + 1, len(groups))
    base = figures[1].wall_s_per_object
    for f in figures.values():
        f.base_wall_s = base
    return [figures[w] for w in windows]


@dataclass(frozen=True)
class Recommendation:
    window: int  # 1: leave window decoding off
    best: WindowFigures  # the fastest window measured (window 1 possibly)
    margin: float

    @property
    def line(self) -> str:
        b = self.best
        if self.window == 1:
            why = ("window 1 had the best decode wall clock" if b.window == 1 else
                   f"the fastest, window {b.window}, took {b.wall_vs_window_1:.2f}x window 1's decode wall "
                   f"clock per object, not {1 - self.margin:.2f}x or less")
            return f"recommendation: leave {DECODE_WINDOW_SETTING} at 1 ({why})"
        same = "" if b.identical_share == 1 else \
            f"; {b.identical}/{b.objects} objects token-identical to window 1"
        return (f"recommendation: set \"{DECODE_WINDOW_SETTING}\": {b.window} in the version's version.json "
                f"(window {b.window}: {b.speedup:.2f}x window 1's decode speed per object{same})")


def recommend(figures: list[WindowFigures], margin: float = MARGIN) -> Recommendation:
    """The window with the best decode wall clock per object, kept only when it takes at most
    (1 - margin) of window 1's; else window 1."""
    best = min(figures, key=lambda f: f.wall_s_per_object)
    chosen = best.window if best.wall_vs_window_1 <= 1 - margin else 1
    return Recommendation(chosen, best, margin)


def table(figures: list[WindowFigures]) -> list[str]:
    """The figures as aligned text rows, a header first."""
    header = ("window", "tokens/forward", "forwards/object", "identical to 1", "decode ms/object", "speed-up")
    rows = [header] + [
        (str(f.window), f"{f.tokens_per_forward:.2f}", f"{f.forwards_per_object:.1f}",
         f"{f.identical}/{f.objects} ({f.identical_share:.0%})", f"{f.wall_s_per_object * 1e3:.1f}",
         f"{f.speedup:.2f}x")
        for f in figures]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def default_prompts(count: int) -> list[str]:
    """`count` prompts of the demo data (procedural shapes' descriptions: "a large dining table")."""
    from cubeserve.demo.shapes import sample_shapes

    return [s.prompt for s in sample_shapes(count, seed=1)]


def read_prompts(path: str | Path, option: str = "--prompts-file") -> list[str]:
    """One prompt per line of `path`, blank lines skipped; ValueError naming `option` when the
    file is missing, unreadable or holds no prompt."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{option} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{option} {path}: cannot be read as UTF-8 text ({exc})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{option} {path}: holds no prompt; give at least 1, one prompt per line")
    return prompts
