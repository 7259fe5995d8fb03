#![no_main]
//! See `warmpath::fuzzing::openai_request`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::openai_request(data));
