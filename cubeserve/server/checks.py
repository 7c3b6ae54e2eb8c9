"""What a client may send in an inference request, whichever port it comes through: the rules the
REST front end (server/front.py) and the gRPC front end (server/grpc_front.py) share.

Why a list of what is allowed rather than of what is not: every parameter of a request reaches
tritonserver's C++ and then the models, and some of Triton 2.51's paths fail badly on values a
client picks. An output's `classification` (gRPC `class_count`) divides by the element size of
a BYTES output, 0, and the whole server dies of SIGFPE (fixed upstream in server#8267); a number
in place of a string, or a value past the datatype's range, is a 500 or silently wraps (2**40 as
INT32 arrives as 0). And the models take some parameters from our own code only: the engine's
control parameters (`cube3d_*`, serving/protocol.py: a client could cancel another client's
generation by its id, or pass a draining server), and the tenant, which the gateway sets as a
header and a body parameter of the same name would override. So only what the predict API
documents passes, each value checked against its type; anything else is a 400 naming it.
"""

from __future__ import annotations

import math
import re

from cubeserve.serving.experiment import BAND_KEY, MODEL_KEY, PIN_ARM_KEY, TENANT_KEY, USER_KEY

MAX_TENSORS = 32  # inputs, and outputs, of one request
MAX_RANK = 8
MAX_ELEMENTS = 1 << 24  # of one input tensor
MAX_PARAMETERS = 32
MAX_NAME_BYTES = 256
MAX_STRING_BYTES = 1 << 20  # one string value in a request (the body bound applies as well)
MAX_KEY_BYTES = 256  # a user key or an arm name

# Model names in paths and requests: Triton's own characters, never "." or ".." (a path segment).
NAME = r"(?!\.{1,2}(?![A-Za-z0-9_.\-]))[A-Za-z0-9_.\-]{1,256}"
_NAME = re.compile(NAME)


class Refused(Exception):
    """A request a front end answers itself: `status` (HTTP) and a message naming the field;
    `retry_after` (seconds) for a Retry-After header."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


# -- values ----------------------------------------------------------------------------------------

def string(value, where: str, limit: int = MAX_STRING_BYTES) -> str:
    if not isinstance(value, str):
        raise Refused(400, f"{where}: must be a string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise Refused(400, f"{where}: is not valid UTF-8 (a lone surrogate)") from None
    if size > limit:
        raise Refused(400, f"{where}: is longer than {limit} bytes")
    return value


def name(value, where: str) -> str:
    string(value, where, MAX_NAME_BYTES)
    if not _NAME.fullmatch(value):
        raise Refused(400, f"{where}: {value[:64]!r} is not a model name (1 to 256 of A-Z a-z 0-9 _ . -, "
                           "not '.' or '..')")
    return value


def integer(low: int, high: int):
    def check(value, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise Refused(400, f"{where}: must be an integer in [{low}, {high}], got {_shown(value)}")
        if not low <= value <= high:
            raise Refused(400, f"{where}: must be an integer in [{low}, {high}], got {value}")
        return value
    return check


def boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise Refused(400, f"{where}: must be true or false, got {_shown(value)}")
    return value


def number(largest: float):
    def check(value, where: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise Refused(400, f"{where}: must be a number, got {_shown(value)}")
        if not (math.isfinite(value) and abs(value) <= largest):  # 1e999 parses as inf
            raise Refused(400, f"{where}: must be a finite number of magnitude at most {largest:g}, got {value:g}")
        return value
    return check


def _shown(value) -> str:
    shown = repr(value) if not isinstance(value, str) else repr(value[:32])
    return f"{type(value).__name__} {shown}"


# -- tensors ---------------------------------------------------------------------------------------

def _int_range(bits: int, signed: bool):
    return integer(-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else integer(0, (1 << bits) - 1)


# Each v2 datatype (Open Inference Protocol; Triton's BYTES and BF16 included) with the check of
# one element of it in JSON. FP16 and BF16 have no JSON form in Triton (binary data only).
ELEMENT = {
    "BOOL": boolean, "BYTES": string,
    "INT8": _int_range(8, True), "INT16": _int_range(16, True), "INT32": _int_range(32, True),
    "INT64": _int_range(64, True), "UINT8": _int_range(8, False), "UINT16": _int_range(16, False),
    "UINT32": _int_range(32, False), "UINT64": _int_range(64, False),
    "FP32": number(3.4028234663852886e38), "FP64": number(1.7976931348623157e308),
    "FP16": None, "BF16": None,
}
DATATYPES = frozenset(ELEMENT)


def element_check(datatype: str, where: str):
    """The check of one JSON element of `datatype`; Refused for a datatype JSON cannot carry."""
    check = ELEMENT[datatype]
    if check is None:
        raise Refused(400, f"{where}: {datatype} data has no JSON form; send it as binary data "
                           "(the binary tensor extension)")
    return check


# -- parameters ------------------------------------------------------------------------------------

_UINT64 = integer(0, (1 << 64) - 1)
# What a client may set, and how: the request's own parameters (Triton's `timeout` in
# microseconds and `priority`; `binary_data_output` for the binary tensor extension; the empty
# final response a stream client may ask for (tritonclient's enable_empty_final_response); the
# experiment's user key and arm pin, which are also headers), an input's and an output's.
REQUEST_PARAMETERS = {"timeout": _UINT64, "priority": _UINT64, "binary_data_output": boolean,
                      "triton_enable_empty_final_response": boolean,
                      USER_KEY: lambda v, w: string(v, w, MAX_KEY_BYTES),
                      PIN_ARM_KEY: lambda v, w: string(v, w, MAX_KEY_BYTES)}
INPUT_PARAMETERS = {"binary_data_size": _UINT64}
OUTPUT_PARAMETERS = {"binary_data": boolean}
# Why some names are refused, in the words a client should read.
REFUSED_PARAMETERS = {
    "classification": "classification is not served (Triton 2.51 crashes on a classification of a BYTES output)",
    "shared_memory_region": "shared memory is not accepted by this server; send the tensor in the request",
    "shared_memory_offset": "shared memory is not accepted by this server; send the tensor in the request",
    "shared_memory_byte_size": "shared memory is not accepted by this server; send the tensor in the request",
    TENANT_KEY: "the tenant is set by the gateway (its header), never by a request",
    MODEL_KEY: "the model is set by the gateway (its header), never by a request",
    BAND_KEY: "the priority band is set by the gateway (its header), never by a request",
}


def canonical(key: str) -> str:
    """A parameter's name as it is compared: the x-cube3d-... ones in any case, as headers are."""
    return key.lower() if key.lower().startswith("x-cube3d-") else key


def parameters(value, where: str, allowed: dict, also: str = "") -> dict:
    """A `parameters` object: each key one of `allowed` (the x-cube3d-... ones in any case, as
    headers are), once, with a value of its type; Refused naming the first that is not. `also`:
    what else the place takes, for the message about an unknown key."""
    if not isinstance(value, dict):
        raise Refused(400, f"{where}: must be an object")
    if len(value) > MAX_PARAMETERS:
        raise Refused(400, f"{where}: has {len(value)} entries, at most {MAX_PARAMETERS} are allowed")
    seen = set()
    for key, item in value.items():
        string(key, f"{where}: a key", MAX_NAME_BYTES)
        name = canonical(key)
        if name in REFUSED_PARAMETERS:
            raise Refused(400, f"{where}.{key}: {REFUSED_PARAMETERS[name]}")
        if name not in allowed:
            raise Refused(400, f"{where}.{key[:64]}: unknown parameter (allowed: {', '.join(allowed) or 'none'}{also})")
        if name in seen:
            raise Refused(400, f"{where}.{key}: given twice (names of the x-cube3d- parameters ignore case)")
        seen.add(name)
        allowed[name](item, f"{where}.{key}")
    return value
