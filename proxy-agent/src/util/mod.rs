//! Small helpers every layer may use; they import nothing from the crate.

pub mod error_chain;
pub mod intern;
