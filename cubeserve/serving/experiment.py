"""An experiment inside one server: A/B arms and a shadow test between loaded checkpoint versions.

The predict model `cube3d` (serving/triton_predict.py) reads it and decides, per request, which
version of `cube3d_stream` serves it and whether a copy also goes to a shadow version. Written as
JSON, e.g.

    {"name": "decoder-v2",
     "arms": [{"name": "control", "version": 1, "weight": 90},
              {"name": "candidate", "version": 2, "weight": 10}],
     "shadow": {"version": 3, "share": 0.25, "max_in_flight": 4}}

`arms` (optional): a request with a user key goes to the arm chosen by a hash of the
experiment's `salt` (default: its name) and the key, so one user always gets the same arm of one
experiment, on every replica, without any state; requests without a key are split at random by
weight. Arms are laid out in order on [0, 1), so raising the last arm's weight only moves users
into it. Without `arms`, requests go to the version the client called.
`shadow` (optional): that share of the requests is also sent to the shadow version, whose answer
is compared with the served one and never returned.

Where the server reads it: the file named by the environment variable EXPERIMENT_FILE_ENV while
it exists (on Kubernetes a ConfigMap mounted into the pod; the predict model re-reads it when it
changes, so a new experiment or new weights take effect without a restart), else the predict model's
config parameter `experiment` (set when the model is loaded through Triton's model-control API,
as the pipeline's local target does).

Requests that name a version (`/v2/models/cube3d/versions/2/infer`) are pinned to it: no arm,
no shadow. A request may also pin an arm by name (PIN_ARM_KEY), e.g. for a QA check.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field

from cubeserve.requests import InvalidRequest

# The user key: the HTTP header or gRPC metadata `x-cube3d-user`, which tritonserver forwards to
# the model as a request parameter of that name (deploy.COMMON_FLAGS' header-forward patterns),
# or the same name as a request parameter in the body.
USER_KEY = "x-cube3d-user"
PIN_ARM_KEY = "x-cube3d-arm"
# The tenant a request is served for: set by the gateway (cubeserve/gateway), which overwrites
# whatever a client sent. Forwarded to the models as USER_KEY is; an experiment assigns a request
# without a user key by its tenant, and the per-tenant meters (serving/metrics.py) count it.
TENANT_KEY = "x-cube3d-tenant"
# The model a request was sent to, by the gateway's name for it (cube3d, cube3d-v05, ...): set by
# the gateway too, for the per-tenant meters' `model` label.
MODEL_KEY = "x-cube3d-model"
# The tenant's priority band (requests.BANDS), set by the gateway from its file as TENANT_KEY is:
# the engine gives waiting requests their slots by band (cubeserve/engine/admission.py).
BAND_KEY = "x-cube3d-band"
EXPERIMENT_FILE_ENV = "CUBE3D_EXPERIMENT_FILE"
EXPERIMENT_PARAMETER = "experiment"  # the config.pbtxt parameter of the predict model
MAX_WEIGHT = 1_000_000
DEFAULT_SHADOW_IN_FLIGHT = 4


@dataclass(frozen=True)
class Arm:
    name: str
    version: int
    weight: float


@dataclass(frozen=True)
class Shadow:
    version: int
    share: float
    max_in_flight: int = DEFAULT_SHADOW_IN_FLIGHT


@dataclass(frozen=True)
class Experiment:
    name: str
    arms: tuple[Arm, ...] = ()
    shadow: Shadow | None = None
    salt: str = ""
    _bounds: tuple[float, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        total = sum(a.weight for a in self.arms)
        bounds, acc = [], 0.0
        for arm in self.arms:
            acc += arm.weight / total
            bounds.append(acc)
        object.__setattr__(self, "_bounds", tuple(bounds))

    @property
    def versions(self) -> set[int]:
        """Every version the experiment sends requests to."""
        return {a.version for a in self.arms} | ({self.shadow.version} if self.shadow else set())

    def arm_for(self, user_key: str | None, pinned: str | None = None, rng: random.Random | None = None) -> Arm | None:
        """The arm that serves a request: the pinned one, else by the user key's hash, else at
        random by weight. None without arms."""
        if not self.arms:
            return None
        if pinned:
            for arm in self.arms:
                if arm.name == pinned:
                    return arm
            raise InvalidRequest(PIN_ARM_KEY, f"no arm {pinned!r} in experiment {self.name!r}; "
                                              f"arms: {[a.name for a in self.arms]}")
        point = bucket(self.salt or self.name, user_key) if user_key else (rng or random).random()
        for arm, bound in zip(self.arms, self._bounds):
            if point < bound:
                return arm
        return self.arms[-1]  # rounding at 1.0

    def shadowed(self, rng: random.Random | None = None) -> bool:
        return self.shadow is not None and (rng or random).random() < self.shadow.share

    def to_json(self) -> str:
        body: dict = {"name": self.name}
        if self.salt:
            body["salt"] = self.salt
        if self.arms:
            body["arms"] = [{"name": a.name, "version": a.version, "weight": a.weight} for a in self.arms]
        if self.shadow:
            body["shadow"] = {"version": self.shadow.version, "share": self.shadow.share,
                              "max_in_flight": self.shadow.max_in_flight}
        return json.dumps(body)


def bucket(salt: str, user_key: str) -> float:
    """A user's point in [0, 1) for one experiment: the first 8 bytes of SHA-256(salt, key)."""
    digest = hashlib.sha256(f"{salt}\x00{user_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def _version(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: must be a checkpoint version (an integer >= 1), got {value!r}")
    return value


def _number(where: str, value, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{where}: must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def parse(text: str) -> Experiment | None:
    """An experiment from its JSON; None for an empty text (no experiment). ValueError names the
    field at fault."""
    if not text.strip():
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"experiment: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError("experiment: must be a JSON object")
    unknown = set(body) - {"name", "salt", "arms", "shadow"}
    if unknown:
        raise ValueError(f"experiment: unknown fields {sorted(unknown)} (allowed: name, salt, arms, shadow)")
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("experiment.name: must be a non-empty string")
    salt = body.get("salt", "")
    if not isinstance(salt, str):
        raise ValueError("experiment.salt: must be a string")
    raw_arms = body.get("arms") or []
    if not isinstance(raw_arms, list):
        raise ValueError("experiment.arms: must be a list of {name, version, weight}")
    arms = []
    for i, raw in enumerate(raw_arms):
        where = f"experiment.arms[{i}]"
        if not isinstance(raw, dict) or set(raw) - {"name", "version", "weight"}:
            raise ValueError(f"{where}: must be an object with name, version and weight")
        arm_name = raw.get("name")
        if not isinstance(arm_name, str) or not arm_name or arm_name == "shadow":
            raise ValueError(f"{where}.name: must be a non-empty string other than 'shadow'")
        arms.append(Arm(arm_name, _version(f"{where}.version", raw.get("version")),
                        _number(f"{where}.weight", raw.get("weight"), 0, MAX_WEIGHT)))
    if len({a.name for a in arms}) != len(arms):
        raise ValueError("experiment.arms: arm names must be unique")
    if arms and sum(a.weight for a in arms) <= 0:
        raise ValueError("experiment.arms: the weights must not all be 0")
    shadow = None
    if body.get("shadow") is not None:
        raw = body["shadow"]
        if not isinstance(raw, dict) or set(raw) - {"version", "share", "max_in_flight"}:
            raise ValueError("experiment.shadow: must be an object with version, share and optionally max_in_flight")
        in_flight = raw.get("max_in_flight", DEFAULT_SHADOW_IN_FLIGHT)
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or not 1 <= in_flight <= 1024:
            raise ValueError(f"experiment.shadow.max_in_flight: must be an integer in [1, 1024], got {in_flight!r}")
        shadow = Shadow(_version("experiment.shadow.version", raw.get("version")),
                        _number("experiment.shadow.share", raw.get("share"), 0, 1), in_flight)
    return Experiment(name=name, arms=tuple(arms), shadow=shadow, salt=salt)
