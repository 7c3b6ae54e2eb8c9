"""Traces: one W3C trace per request, from the client through the gateway (Envoy's own tracer),
the REST front end, tritonserver (its OpenTelemetry mode) and the engine, to an OpenTelemetry
collector or Jaeger (docs/gateway/regions-models-traces.md).

On only where the standard variable OTEL_EXPORTER_OTLP_ENDPOINT names a collector's OTLP/HTTP
endpoint (http://HOST:4318): each process that sees it exports its spans there with the
OpenTelemetry SDK (`pip install 'cubeserve[tracing]'`); without it, or without the SDK, nothing
is traced and nothing is imported. The context travels as W3C `traceparent` headers; between
the front end and the python models, where tritonserver passes on only x-cube3d-* headers
(deploy.HTTP_HEADER_FORWARD_PATTERN), as TRACE_KEY.
"""

from __future__ import annotations

import os
import threading

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACE_KEY = "x-cube3d-traceparent"  # the front end's span, for the models (a client's is dropped)
_LOCK = threading.Lock()
_PROVIDERS: dict[tuple[str, str], object] = {}  # (service, endpoint) -> its TracerProvider (None: no SDK)


def endpoint() -> str | None:
    return os.environ.get(ENDPOINT_ENV) or None


def tracer(service: str):
    """An OpenTelemetry tracer exporting as `service`, or None where tracing is off."""
    if not endpoint():
        return None
    key = (service, endpoint())  # a provider exports where the variable said when it was made
    with _LOCK:
        if key not in _PROVIDERS:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                from opentelemetry.sdk.resources import Resource
                from opentelemetry.sdk.trace import TracerProvider
                from opentelemetry.sdk.trace.export import BatchSpanProcessor
            except ImportError:
                _PROVIDERS[key] = None
            else:
                # A provider per service (several live in one process in the tests), not the global one.
                provider = TracerProvider(resource=Resource.create({"service.name": service}))
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=200))
                _PROVIDERS[key] = provider
        provider = _PROVIDERS[key]
        return provider.get_tracer("cubeserve") if provider is not None else None


def flush() -> None:
    """Export what is buffered (before a process ends)."""
    for provider in list(_PROVIDERS.values()):
        if provider is not None:
            provider.force_flush(5000)


TRITON_SERVICE = "cube3d-triton"


def tritonserver_flags(collector: str | None) -> list[str]:
    """tritonserver's OpenTelemetry mode, every request traced (the sampling is the caller's:
    tritonserver joins the trace of the traceparent it is sent), spans to `collector`'s
    OTLP/HTTP endpoint; none where `collector` is None."""
    if not collector:
        return []
    url = collector.rstrip("/").removeprefix("http://") + "/v1/traces"
    return ["--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
            "--trace-config", "rate=1", "--trace-config", "count=-1",
            "--trace-config", f"opentelemetry,url={url}",
            "--trace-config", f"opentelemetry,resource=service.name={TRITON_SERVICE}",
            "--trace-config", "opentelemetry,bsp_schedule_delay=200"]


def extract(headers) -> object:
    """The context a `traceparent` header (any mapping of headers) carries; an empty one if none."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    value = _get(headers, "traceparent")
    return TraceContextTextMapPropagator().extract({"traceparent": value} if value else {})


def traceparent(span) -> str:
    """The W3C `traceparent` of `span` (what a child of it is sent)."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def new_traceparent() -> str:
    """A new sampled trace's first `traceparent` (a client that exports no span of its own)."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"


def trace_id(value: str) -> str:
    return value.split("-")[1]


def _get(headers, name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None
