#![no_main]
//! See `warmpath::fuzzing::raft_rpc`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| warmpath::fuzzing::raft_rpc(data));
