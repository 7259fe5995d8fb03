#![no_main]
//! See `warmpath::fuzzing::decision_batch`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::decision_batch(data));
