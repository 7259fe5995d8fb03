#![no_main]
//! See `warmpath::fuzzing::kv_events`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::kv_events(data));
