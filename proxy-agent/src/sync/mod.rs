//! The one sync loop: a source's deltas into the model, decisions, plans
//! and map writes, with the Events and metrics that report on them.

pub mod events;
pub mod pass;
pub mod sync_loop;
