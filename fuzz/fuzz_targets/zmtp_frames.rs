#![no_main]
//! See `warmpath::fuzzing::zmtp_frames`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::zmtp_frames(data));
