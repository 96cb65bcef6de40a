//! API server response bodies as the watchers deserialize them (lists,
//! watch events, objects) in the slim wire shapes of Services,
//! EndpointSlices (v1 and v1beta1) and Nodes, converted and decided.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| proxy_agent::fuzzing::watch_body(data));
