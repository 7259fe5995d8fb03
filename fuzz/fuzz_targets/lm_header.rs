#![no_main]
//! See `warmpath::fuzzing::lm_header`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::lm_header(data));
