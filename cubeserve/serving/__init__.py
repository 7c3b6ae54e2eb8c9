"""What runs inside Triton's python backend stubs: the two models (the predict API and the
engine's stream model), their protocol, experiments, metrics and the model repository; and what
both sides of the stub boundary share (the drain's markers, the stubs' lifetime). The processes
around Triton are cubeserve/server/."""
