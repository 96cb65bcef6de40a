//! Manifest files as `--manifests` reads them: YAML streams, JSON, `List`
//! and `*List` objects, converted into the model and decided.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| proxy_agent::fuzzing::manifest(data));
