//! The agent's subscription to its engines' KV events (the I/O around `ingest.rs`): one
//! task per engine, a ZMQ SUB socket connected to the engine's publisher (the `zeromq`
//! crate reconnects after a publisher restart), each message's sequence number and batch
//! decoded and applied, and the resulting changes recorded in the residency publisher.
//!
//! A message that is not three frames with an 8-byte sequence, or a batch that does not
//! decode, is counted and skipped; the next good batch's sequence number then shows the
//! gap. With a replay endpoint (`--kv-events NAME=EVENTS,REPLAY`) the subscriber asks the
//! engine for the missing batches as vLLM's replay socket answers (a DEALER sends
//! `[empty, start sequence]`; the engine answers `[empty, sequence, batch]` per kept batch,
//! then a sequence of -1 with an empty batch) and applies them in order, waiting at most
//! [`REPLAY_WAIT`]. What replay cannot fill, `ingest` handles by dropping and rebuilding
//! that engine's view. Messages over
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

/// How long a replay may take before the gap is left to `ingest`.
pub const REPLAY_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Subscribes to `endpoint` (`tcp://…`, or `tcp://EVENTS,tcp://REPLAY`) as engine
/// `engine` until the task is dropped.
pub async fn subscribe(
    engine: usize,
    endpoint: String,
    ingest: Arc<Mutex<Ingest>>,
    residency: Arc<Mutex<Publisher>>,
    changed: Arc<tokio::sync::Notify>,
) {
    let (endpoint, replay_at) = match endpoint.split_once(',') {
        Some((events, replay)) => (events.to_string(), Some(replay.to_string())),
        None => (endpoint, None),
    };
    let mut replay: Option<zeromq::DealerSocket> = None;
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
        let (seq, payload) = match crate::kv_events::parse_message(&frames) {
            Some(m) if size <= MAX_MESSAGE_BYTES => m,
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
        let last = ingest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last_seq(engine);
        let mut changes = Vec::new();
        if let (Some(last), Some(at)) = (last, &replay_at) {
            if seq > last.wrapping_add(1) {
                let missed = fill_gap(&mut replay, at, last + 1, seq).await;
                let mut ingest = ingest.lock().unwrap_or_else(|p| p.into_inner());
                for (s, b) in &missed {
                    changes.extend(ingest.apply(engine, *s, b));
                }
                let filled = ingest.last_seq(engine) == Some(seq - 1);
                let result = if filled { "filled" } else { "incomplete" };
                counter!("warmpath_agent_kv_replays_total", "result" => result).increment(1);
            }
        }
        changes.extend(
            ingest
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .apply(engine, seq, &batch),
        );
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

/// The batches `from..to` from the engine's replay socket at `at`, in order, as far as it
/// still keeps them (connecting on first use; a failure drops the connection).
async fn fill_gap(
    replay: &mut Option<zeromq::DealerSocket>,
    at: &str,
    from: u64,
    to: u64,
) -> Vec<(u64, crate::kv_events::Decoded)> {
    use zeromq::SocketSend;
    let mut got = Vec::new();
    if replay.is_none() {
        let mut s = zeromq::DealerSocket::new();
        match tokio::time::timeout(REPLAY_WAIT, s.connect(at)).await {
            Ok(Ok(())) => *replay = Some(s),
            _ => {
                tracing::debug!(replay = %at, "cannot connect to the engine's replay socket");
                return got;
            }
        }
    }
    let Some(socket) = replay.as_mut() else {
        return got;
    };
    let request = zeromq::ZmqMessage::try_from(vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&from.to_be_bytes()),
    ]);
    let Ok(request) = request else { return got };
    if socket.send(request).await.is_err() {
        *replay = None;
        return got;
    }
    let deadline = tokio::time::Instant::now() + REPLAY_WAIT;
    let mut next = from;
    loop {
        let Ok(Ok(msg)) = tokio::time::timeout_at(deadline, socket.recv()).await else {
            // A late answer would be read as the next one's: start afresh next time.
            *replay = None;
            return got;
        };
        // `[empty delimiter, sequence, batch]`: the shape of a published message.
        let frames = msg.into_vec();
        let Some((seq, payload)) = crate::kv_events::parse_message(&frames) else {
            return got;
        };
        if payload.is_empty() {
            return got; // the end marker
        }
        if seq < next || seq >= to {
            continue;
        }
        if seq != next || payload.len() > MAX_MESSAGE_BYTES {
            // The engine no longer keeps what comes first: the gap stays.
            continue;
        }
        match decode_batch(payload) {
            Ok(b) => {
                got.push((seq, b));
                next += 1;
            }
            Err(_) => {
                counter!("warmpath_agent_kv_batches_total", "result" => "malformed").increment(1);
            }
        }
    }
}
