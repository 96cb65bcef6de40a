//! The pure core: topology ranking, the per-port decision, the decision
//! cache kept between syncs, and the plan (diff) against the maps. Nothing
//! here imports kube, aya or tokio.

pub(crate) mod cache;
pub mod decision;
pub mod departures;
pub mod label_wait;
pub mod maglev;
pub mod plan;
pub(crate) mod topology;
