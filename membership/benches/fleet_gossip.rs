//! Gossip bytes of routing decisions at fleet scale (issue 27, part 1): the decisions one
//! production `RouterCore` queued for its peers (written by `cargo bench -p warmpath-sim
//! --bench fleet` as one line per decision: arrival µs, instance key, comma-separated keys),
//! batched by the production [`Batcher`] (8 KiB values) every 50 ms of their arrival time
//! and encoded as the [`BatchWire`] strings that chitchat stores and sends.
//!
//! Run with `FLEET_OUTBOX=/tmp/fleet-outbox-chat.txt cargo bench -p warmpath-membership
//! --bench fleet_gossip` (several files: comma-separated). Prints encoded bytes per routed
//! request (`FLEET_REQUESTS_<NAME>` requests, as the sim bench printed, else per decision).

use std::time::Instant;
use warmpath_index::keys::BlockKey;
use warmpath_membership::decisions::{encode, BatchWire, Batcher, Decision};
use warmpath_membership::schema::BATCH_MAX_BYTES;

const ROUND_US: u64 = 50_000;

fn main() {
    let files = std::env::var("FLEET_OUTBOX").unwrap_or_default();
    for path in files.split(',').filter(|p| !p.is_empty()) {
        let t = Instant::now();
        let text = std::fs::read_to_string(path).expect("readable outbox file");
        let mut batcher = Batcher::new(BATCH_MAX_BYTES, 0);
        let (mut bytes, mut batches, mut decisions, mut keys) = (0u64, 0u64, 0u64, 0u64);
        let mut round_end = ROUND_US;
        let flush = |batcher: &mut Batcher, now_us: u64, bytes: &mut u64, batches: &mut u64| {
            for d in batcher.take_all() {
                *bytes += encode(&BatchWire::V1 {
                    made_at_ms: 1_764_000_000_000 + now_us / 1000,
                    decisions: d,
                })
                .len() as u64;
                *batches += 1;
            }
        };
        for line in text.lines() {
            let mut parts = line.split(' ');
            let (Some(at), Some(inst), Some(ks)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let at: u64 = at.parse().expect("arrival µs");
            while at >= round_end {
                flush(&mut batcher, round_end, &mut bytes, &mut batches);
                round_end += ROUND_US;
            }
            let d = Decision {
                instance: inst.parse().expect("instance key"),
                keys: ks
                    .split(',')
                    .map(|k| BlockKey(k.parse().expect("key")))
                    .collect(),
            };
            decisions += 1;
            keys += d.keys.len() as u64;
            batcher.push(at / 1000, d);
        }
        flush(&mut batcher, round_end, &mut bytes, &mut batches);
        let name = path
            .rsplit('/')
            .next()
            .unwrap_or(path)
            .trim_start_matches("fleet-outbox-")
            .trim_end_matches(".txt")
            .to_uppercase();
        let requests: f64 = std::env::var(format!("FLEET_REQUESTS_{name}"))
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(decisions as f64);
        println!(
            "{path}: {decisions} decisions, {keys} keys, {batches} batches (50 ms rounds, {BATCH_MAX_BYTES}-byte values): {bytes} encoded bytes, {:.1} per decision, {:.1} per request over {requests} requests ({:.2} s)",
            bytes as f64 / decisions.max(1) as f64,
            bytes as f64 / requests.max(1.0),
            t.elapsed().as_secs_f64()
        );
    }
}
