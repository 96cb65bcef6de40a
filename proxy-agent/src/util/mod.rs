//! Small helpers every layer may use; they import nothing from the crate.

pub(crate) mod btree;
pub(crate) mod error_chain;
pub(crate) mod intern;
pub(crate) mod periodic;
pub(crate) mod u64_map;
