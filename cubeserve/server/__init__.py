"""The processes around Triton: the supervisor that starts and restarts tritonserver, the REST
and gRPC front ends in front of it (their request checks and load reports), and the local server
the CLI and the tests start. Nothing here is imported inside Triton's python stubs; what runs
there is cubeserve/serving/."""
