//! What operators see of the agent: Prometheus metrics and the
//! `/healthz`, `/livez`, `/readyz`, `/metrics` HTTP server. Nothing here
//! imports from the rest of the crate: callers hand in plain figures.

pub mod health_server;
pub mod metrics;
pub mod service_connections;
