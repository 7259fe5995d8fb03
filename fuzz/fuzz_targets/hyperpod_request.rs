#![no_main]
//! See `warmpath::fuzzing::hyperpod_request`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::hyperpod_request(data));
