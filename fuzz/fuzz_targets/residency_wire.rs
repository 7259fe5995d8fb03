#![no_main]
//! See `warmpath::fuzzing::residency_wire`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::residency_wire(data));
