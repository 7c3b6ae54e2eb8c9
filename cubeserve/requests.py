"""A generation request, its defaults and its validation.

Every entry point (CLI, Triton model, pipelines) builds a `GenerationRequest` and calls
`validate`, so that bad input gets one clear error naming the field and its allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_RESOLUTION, MAX_RESOLUTION = 4, 9
MAX_PROMPT_BYTES = 4096  # far above 77 CLIP tokens; longer prompts are truncated by CLIP anyway
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100.0
MAX_TEMPERATURE = 100.0
BBOX_LONGEST_SIDE = 1.925  # the reference CLI's normalisation of a bounding box
FORMATS = ("glb", "obj")


class InvalidRequest(ValueError):
    """A request field out of range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Unavailable(RuntimeError):
    """The request cannot be served now (the server is busy, its deadline passed, the engine is
    stopping or gone): nothing was wrong with it, and a retry here later or elsewhere may work.
    The message starts with "unavailable:" so that it is recognised across Triton's BLS, which
    carries no error codes."""

    PREFIX = "unavailable:"

    def __init__(self, message: str):
        super().__init__(f"{self.PREFIX} {message}")


class Shed(Unavailable):
    """Refused or dropped from the engine's queue to serve others first: a higher priority band,
    or another tenant of the same band with less than its share of the queue, or the request
    waited longer than the queue allows. A retry here after a while may work (HTTP 429 with
    Retry-After, gRPC RESOURCE_EXHAUSTED), unlike `Unavailable`'s "no capacity" (503), which a
    gateway retries elsewhere at once."""

    PREFIX = "unavailable: shed:"

    def __init__(self, message: str):
        RuntimeError.__init__(self, f"{self.PREFIX} {message}")


# Priority bands, served in this order when requests wait for a slot (cubeserve/engine/
# admission.py); a request's band is its tenant's in the gateway's file, else DEFAULT_BAND.
BANDS = ("interactive", "standard", "batch")
DEFAULT_BAND = "standard"


def band_rank(band: str | None, field: str = "band") -> int:
    """0 for the band served first; InvalidRequest naming `field` for an unknown band."""
    if band is None or band == "":
        band = DEFAULT_BAND
    try:
        return BANDS.index(band.lower())
    except ValueError:
        raise InvalidRequest(field, f"must be one of {', '.join(BANDS)}, got {band!r}") from None


@dataclass
class GenerationRequest:
    prompt: str = ""
    seed: int = 0
    guidance_scale: float = 3.0
    top_p: float | None = None  # None: no top-p filtering
    temperature: float | None = None  # None with top_p None: greedy (the reference default)
    resolution: int = 8
    bbox: tuple[float, float, float] | None = None  # object size (x, y, z); v0.5-style models only
    format: str = "glb"

    @property
    def greedy(self) -> bool:
        return self.top_p is None and self.temperature is None

    def normalized_bbox(self) -> tuple[float, float, float] | None:
        """The box scaled so that its longest side is 1.925, as the reference CLI does."""
        if self.bbox is None:
            return None
        longest = max(self.bbox)
        return tuple(float(v) / longest * BBOX_LONGEST_SIDE for v in self.bbox)

    def validate(self, uses_bbox: bool = True) -> "GenerationRequest":
        if not isinstance(self.prompt, str):
            raise InvalidRequest("prompt", "must be a string")
        if len(self.prompt.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
            raise InvalidRequest("prompt", f"is longer than {MAX_PROMPT_BYTES} bytes")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequest("seed", f"must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        _check_number("guidance_scale", self.guidance_scale, 0.0, MAX_GUIDANCE, low_open=False)
        if self.top_p is not None:
            _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.temperature is not None:
            _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE, low_open=True)
        if (isinstance(self.resolution, bool) or not isinstance(self.resolution, int)
                or not MIN_RESOLUTION <= self.resolution <= MAX_RESOLUTION):
            raise InvalidRequest(
                "resolution", f"must be an integer in [{MIN_RESOLUTION}, {MAX_RESOLUTION}], got {self.resolution!r}")
        if self.bbox is not None:
            if not uses_bbox:
                raise InvalidRequest("bbox", "this model takes no bounding box (only v0.5-style models do)")
            box = tuple(self.bbox)
            if len(box) != 3:
                raise InvalidRequest("bbox", f"must have 3 sides (x, y, z), got {len(box)}")
            for side in box:
                if not isinstance(side, (int, float)) or not math.isfinite(side) or side <= 0:
                    raise InvalidRequest("bbox", f"every side must be a positive finite number, got {list(box)}")
            self.bbox = tuple(float(s) for s in box)
        if self.format not in FORMATS:
            raise InvalidRequest("format", f"must be one of {list(FORMATS)}, got {self.format!r}")
        return self


def _check_number(field: str, value, low: float, high: float, low_open: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidRequest(field, f"must be a number in {bracket}{low:g}, {high:g}], got {value!r}")
