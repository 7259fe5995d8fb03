#![no_main]
//! See `warmpath::fuzzing::admin_json`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::admin_json(data));
