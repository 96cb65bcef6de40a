//! Topology key lists (`spec.topologyKeys`, the topoproxy.io/topology-keys
//! annotation) and the OpenYurt and topology-mode annotations as raw
//! text, on Services whose endpoints and Nodes carry the labels they name;
//! converted and decided like any object.
#![no_main]

use arbitrary::Unstructured;
use topoproxy_fuzz::{Topology, objects};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    if let Ok(values) = objects(&mut u, Topology::Raw) {
        proxy_agent::fuzzing::objects(&values);
    }
});
