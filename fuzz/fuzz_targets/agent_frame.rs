#![no_main]
//! See `warmpath::fuzzing::agent_frame`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::agent_frame(data));
