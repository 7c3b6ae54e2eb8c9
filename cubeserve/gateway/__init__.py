"""The gateway: one front door for many teams (docs/gateway/index.md). `config` reads the gateway's
file (keys, tenants, quotas, backends), `envoy` renders it as Envoy's configuration and runs a
real Envoy on 127.0.0.1, `usage` reads the per-tenant meters back from Prometheus."""
