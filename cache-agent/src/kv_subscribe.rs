//! The agent's subscription to its engines' KV events (the I/O around `ingest.rs`): one
//! task per engine, a ZMQ SUB socket connected to the engine's publisher (the `zeromq`
//! crate reconnects after a publisher restart), each message's sequence number and batch
//! decoded and applied, and the resulting changes recorded in the residency publisher.
//!
//! A message that is not three frames with an 8-byte sequence, or a batch that does not
//! decode, is counted and skipped; the next good batch's sequence number then shows the
//! gap, and `ingest` drops and rebuilds that engine's view. Messages over
//! [`MAX_MESSAGE_BYTES`] are counted and skipped the same way; the `zeromq` crate has no
//! receive-size limit of its own, so the publishers must be the host's own engines (the
//! agent connects to the endpoints it is given; it listens on nothing for events).

use std::sync::{Arc, Mutex};

use metrics::counter;
use zeromq::{Socket, SocketRecv};

use crate::ingest::Ingest;
use crate::kv_events::decode_batch;
use crate::residency::Publisher;

/// Largest KV-event message decoded (a batch of a long prompt's stores is a few hundred
/// KiB; vLLM batches per scheduler step).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Subscribes to `endpoint` as engine `engine` until the task is dropped.
pub async fn subscribe(
    engine: usize,
    endpoint: String,
    ingest: Arc<Mutex<Ingest>>,
    residency: Arc<Mutex<Publisher>>,
    changed: Arc<tokio::sync::Notify>,
) {
    let mut socket = zeromq::SubSocket::new();
    loop {
        match socket.connect(&endpoint).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(%endpoint, error = %e, "cannot connect to the engine's KV events; retrying");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
    if let Err(e) = socket.subscribe("").await {
        tracing::warn!(%endpoint, error = %e, "cannot subscribe to KV events");
        return;
    }
    tracing::info!(%endpoint, engine, "subscribed to KV events");
    loop {
        let msg = match socket.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(%endpoint, error = %e, "kv event receive failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let frames = msg.into_vec();
        let size: usize = frames.iter().map(|f| f.len()).sum();
        let (seq, payload) = match frames.as_slice() {
            [_topic, seq, payload] if seq.len() == 8 && size <= MAX_MESSAGE_BYTES => (
                u64::from_be_bytes(seq[..].try_into().unwrap_or([0; 8])),
                payload,
            ),
            _ => {
                counter!("warmpath_agent_kv_batches_total", "result" => "malformed").increment(1);
                continue;
            }
        };
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                counter!("warmpath_agent_kv_batches_total", "result" => "malformed").increment(1);
                tracing::debug!(%endpoint, error = %e, "kv event batch refused");
                if let Ok(mut i) = ingest.lock() {
                    i.stats.malformed += 1;
                }
                continue;
            }
        };
        counter!("warmpath_agent_kv_batches_total", "result" => "ok").increment(1);
        counter!("warmpath_agent_kv_events_total").increment(batch.events.len() as u64);
        let changes = ingest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply(engine, seq, &batch);
        if changes.is_empty() {
            continue;
        }
        let mut r = residency.lock().unwrap_or_else(|p| p.into_inner());
        for c in changes {
            r.record(c);
        }
        drop(r);
        changed.notify_one();
    }
}
