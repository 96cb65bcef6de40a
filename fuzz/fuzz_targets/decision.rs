//! The decision function's properties on clusters of the model built
//! directly (every policy, topology model, condition and family mix):
//! every backend it returns is a ready or serving endpoint of the Service
//! port, and a Local policy never returns a remote endpoint.
#![no_main]

use arbitrary::Unstructured;
use topoproxy_fuzz::{NODES, cluster};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(c) = cluster(&mut u) else { return };
    for node in NODES {
        proxy_agent::fuzzing::check_decisions(&c, node);
    }
});
