#![no_main]
//! See `warmpath::fuzzing::gossip_datagram`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::gossip_datagram(data));
