//! The one sync loop: a source's deltas into the model, decisions, plans
//! and map writes, with the Events and metrics that report on them; and
//! `explain`'s input, manifests as `run`'s watches would list them.

pub mod events;
pub mod explain_input;
pub mod pass;
pub mod sync_loop;
