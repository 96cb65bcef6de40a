//! Conversion of Kubernetes objects into the model: Services,
//! EndpointSlices and Nodes built field by field from the fuzzer's bytes
//! (edge values, wrong types, collisions), then decided.
#![no_main]

use arbitrary::Unstructured;
use topoproxy_fuzz::{Topology, objects};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    if let Ok(values) = objects(&mut u, Topology::Pooled) {
        proxy_agent::fuzzing::objects(&values);
    }
});
