#![no_main]
//! See `warmpath::fuzzing::engine_response`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::engine_response(data));
