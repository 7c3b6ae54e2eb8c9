"""KServe's own Python SDK (`kserve` InferenceRESTClient / InferenceGRPCClient, Open Inference
Protocol v2) asking `cube3d` for a mesh, as a KServe user's code would. Run as a separate
process by tests/test_clients.py: kserve's and tritonclient's generated gRPC modules register
the same protobuf names and cannot be imported into one process.

    python tests/kserve_sdk_client.py rest|grpc HOST:PORT PROMPT SEED RESOLUTION [USER]
prints {"mesh_sha256": ..., "tokens": [...], "model_version": ..., "arm": ...} as JSON. USER is
sent as the header x-cube3d-user (an experiment's user key).
"""

import asyncio
import base64
import hashlib
import json
import sys

from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


def _text(output) -> str:
    value = output.as_numpy()[0]
    return value if isinstance(value, str) else bytes(value).decode()


async def main(kind: str, url: str, prompt: str, seed: int, resolution: int, user: str = "") -> dict:
    inputs = [InferInput("PROMPT", [1], "BYTES", [prompt]), InferInput("SEED", [1], "INT64", [seed]),
              InferInput("RESOLUTION", [1], "INT32", [resolution])]
    request = InferRequest(model_name="cube3d", infer_inputs=inputs)
    headers = {"x-cube3d-user": user} if user else None
    if kind == "rest":
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=120))
        response = await client.infer(f"http://{url}", request, model_name="cube3d", headers=headers)
    else:
        client = InferenceGRPCClient(url, timeout=120)
        response = await client.infer(request, headers=list(headers.items()) if headers else None)
    outputs = {o.name: o for o in response.outputs}
    encoded = outputs["MESH"].as_numpy()[0]
    encoded = encoded.encode() if isinstance(encoded, str) else bytes(encoded)
    mesh = base64.b64decode(encoded, validate=True)
    return {"mesh_sha256": hashlib.sha256(mesh).hexdigest(),
            "tokens": [int(t) for t in outputs["SHAPE_TOKENS"].as_numpy()],
            "model_version": _text(outputs["MODEL_VERSION"]), "arm": _text(outputs["ARM"])}


if __name__ == "__main__":
    kind, url, prompt, seed, resolution = sys.argv[1:6]
    user = sys.argv[6] if len(sys.argv) > 6 else ""
    print(json.dumps(asyncio.run(main(kind, url, prompt, int(seed), int(resolution), user))))
