//! The name a frontend's connection counts are exported under: a Service
//! port. The decision gives each frontend one (`decide/`), the map writers
//! keep it beside the service id they hand out (`datapath/`), and the
//! metrics read it back (`observe/`), so it lives here, below all three.

use std::sync::Arc;

/// Who a frontend's counts belong to: a Service port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortLabel {
    /// The Service's namespace.
    pub namespace: Arc<str>,
    /// The Service's name.
    pub service: Arc<str>,
    /// The port's name, or its number when it has none.
    pub port: String,
    /// Whether the Service has a topology setting (exported one by one
    /// under `--service-metrics topology`).
    pub topology: bool,
}
