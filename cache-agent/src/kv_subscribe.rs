//! The agent's subscription to its engines' KV events (the I/O around `ingest.rs`): one
//! task per engine, a ZMQ SUB connection to the engine's publisher ([`crate::zmtp`], which
//! bounds every frame before reading it; connected again a second after it fails, as after
//! a publisher restart), each message's sequence number and batch decoded and applied, and
//! the resulting changes recorded in the residency publisher.
//!
//! A message that is not three frames with an 8-byte sequence, or a batch that does not
//! decode, is counted and skipped; the next good batch's sequence number then shows the
//! gap. With a replay endpoint (`--kv-events NAME=EVENTS,REPLAY`) the subscriber asks the
//! engine for the missing batches as vLLM's replay socket answers (a DEALER sends
//! `[empty, start sequence]`; the engine answers `[empty, sequence, batch]` per kept batch,
//! then a sequence of -1 with an empty batch) and applies them in order, waiting at most
//! [`REPLAY_WAIT`]; vLLM 0.26 and later put the topic before the sequence, and both are
//! read (`kv_events::parse_replay`). What replay cannot fill, `ingest` handles by dropping and rebuilding
//! that engine's view.
//!
//! **Resync.** The same socket rebuilds a whole view: when the subscriber starts (an agent
//! restarted while its engine kept serving: the engine's blocks stored before are never
//! announced again otherwise), and when a fixed-tenant agent receives its first tenant
//! table from a router ([`Ingest::learn_tenants`]). The view is dropped and rebuilt from every
//! batch the engine still keeps, in order; live batches the replay already covered are then
//! skipped as duplicates. vLLM keeps its last `buffer_steps` batches (10,000 by default): a
//! block stored before that window and still held stays unknown until stored again, and a
//! chain whose first blocks fell out of it is counted as orphans. An engine not listening
//! yet is asked again each second. Without a replay socket there is no resync.
//! A message over
//! [`MAX_MESSAGE_BYTES`] ends its connection at the frame header that takes it past the
//! bound, before the frame is read (counted `too_large`); the agent connects to the
//! endpoints it is given and listens on nothing for events.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::counter;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ingest::Ingest;
use crate::kv_events::{decode_batch, Decoded};
use crate::zmtp::{Zmtp, ZmtpError};
use warmpath_residency::{Change, Publisher};

/// Largest KV-event message decoded (a batch of a long prompt's stores is a few hundred
/// KiB; vLLM batches per scheduler step).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Changes recorded under one hold of the residency publisher's lock.
const REPORT_CHUNK: usize = 8192;

/// How long connecting to an engine's socket, with the ZMTP handshake, may take.
const CONNECT_WAIT: Duration = Duration::from_secs(2);

/// How long a replay may take before the gap is left to `ingest`; in a resync, the
/// longest wait for the replay's next message.
pub const REPLAY_WAIT: Duration = Duration::from_millis(500);

/// How long a resync's replay may take in all (vLLM's whole buffer, 10,000 batches).
const RESYNC_WAIT: Duration = Duration::from_secs(30);

/// How long after a resync live batches it already covered are skipped as duplicates
/// (afterwards an old sequence number is an engine restart's, and drops the view).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(2);

/// How often a resync is tried again while the engine's replay socket does not answer.
const RESYNC_RETRY: Duration = Duration::from_secs(1);

/// Subscribes to `endpoint` (`tcp://…`, or `tcp://EVENTS,tcp://REPLAY`) as engine
/// `engine` until the task is dropped; each change of `resyncs` asks for a resync.
pub async fn subscribe(
    engine: usize,
    endpoint: String,
    ingest: Arc<Mutex<Ingest>>,
    residency: Arc<Mutex<Publisher>>,
    changed: Arc<tokio::sync::Notify>,
    resyncs: watch::Receiver<u64>,
) {
    let (endpoint, replay_at) = match endpoint.split_once(',') {
        Some((events, replay)) => (events.to_string(), Some(replay.to_string())),
        None => (endpoint, None),
    };
    let view = View {
        engine,
        ingest,
        residency,
        changed,
    };
    let mut replay = replay_at.map(Replay::new);
    let mut resyncs = Some(resyncs);
    let (tx, mut events) = tokio::sync::mpsc::channel(4);
    let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
    let _reader = AbortOnDrop(tokio::spawn(read_events(
        endpoint.clone(),
        tx,
        subscribed_tx,
    )));
    if subscribed.await.is_err() {
        return;
    }
    tracing::info!(%endpoint, engine, "subscribed to KV events");
    // Subscribed first, so that what the engine publishes while it replays waits here.
    let mut resync_wanted = replay.is_some();
    let mut duplicates: Option<(u64, Instant)> = None;
    loop {
        if resync_wanted {
            match view.resync(replay.as_mut()).await {
                Some(last) => {
                    resync_wanted = false;
                    duplicates = last.map(|l| (l, Instant::now() + DUPLICATE_WINDOW));
                }
                None => tracing::debug!(engine, "the engine's replay socket did not answer"),
            }
        }
        let msg = tokio::select! {
            m = events.recv() => match m {
                Some(m) => m,
                None => return,
            },
            r = async {
                match resyncs.as_mut() {
                    Some(rx) => rx.changed().await,
                    None => std::future::pending().await,
                }
            } => {
                match r {
                    Ok(()) => resync_wanted = replay.is_some(),
                    Err(_) => resyncs = None, // the agent is going away
                }
                continue;
            }
            () = tokio::time::sleep(RESYNC_RETRY), if resync_wanted => continue,
        };
        let frames = msg;
        let size: usize = frames.iter().map(|f| f.len()).sum();
        let (seq, payload) = match crate::kv_events::parse_message(&frames) {
            Some(m) if size <= MAX_MESSAGE_BYTES => m,
            _ => {
                counter!(crate::metric_names::AGENT_KV_BATCHES_TOTAL, "result" => "malformed")
                    .increment(1);
                continue;
            }
        };
        if let Some((upto, until)) = duplicates {
            if seq <= upto && Instant::now() < until {
                counter!(crate::metric_names::AGENT_KV_BATCHES_TOTAL, "result" => "duplicate")
                    .increment(1);
                continue;
            }
            duplicates = None;
        }
        let batch = match cpu(|| decode_batch(payload)) {
            Ok(b) => b,
            Err(e) => {
                counter!(crate::metric_names::AGENT_KV_BATCHES_TOTAL, "result" => "malformed")
                    .increment(1);
                tracing::debug!(%endpoint, error = %e, "kv event batch refused");
                view.lock().stats.malformed += 1;
                continue;
            }
        };
        counter!(crate::metric_names::AGENT_KV_BATCHES_TOTAL, "result" => "ok").increment(1);
        counter!(crate::metric_names::AGENT_KV_EVENTS_TOTAL).increment(batch.events.len() as u64);
        let last = view.lock().last_seq(engine);
        let mut changes = Vec::new();
        if let (Some(last), Some(replay)) = (last, replay.as_mut()) {
            if seq > last.wrapping_add(1) {
                let missed = replay
                    .fetch(last + 1, seq, REPLAY_WAIT)
                    .await
                    .unwrap_or_default();
                let mut ingest = view.lock();
                // Only a run that starts where the view ends fills the gap.
                if missed.first().map(|(s, _)| *s) == Some(last + 1) {
                    for (s, b) in &missed {
                        changes.extend(ingest.apply(engine, *s, b));
                    }
                }
                let filled = ingest.last_seq(engine) == Some(seq - 1);
                let result = if filled { "filled" } else { "incomplete" };
                counter!(crate::metric_names::AGENT_KV_REPLAYS_TOTAL, "result" => result)
                    .increment(1);
            }
        }
        cpu(|| {
            changes.extend(view.lock().apply(engine, seq, &batch));
            view.report(changes);
        });
    }
}

/// Runs `f`, CPU work that may take long (a batch of a quarter million blocks takes
/// seconds in a debug build), without holding up the other tasks of the runtime's worker:
/// the QUIC connections and heartbeats of residency, which a router takes for a dead agent
/// after 1.5 s of silence.
fn cpu<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Aborts a task when dropped (the subscriber's reader goes with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the engine's KV events (ZMQ SUB, [`Zmtp`]: every frame bounded before it is read)
/// into `tx`, connecting again a second after a failure, as a ZMQ SUB socket would;
/// `subscribed` fires on the first subscription. A message over [`MAX_MESSAGE_BYTES`]
/// ends the connection before its body is read, counted `too_large`.
async fn read_events(
    endpoint: String,
    tx: tokio::sync::mpsc::Sender<Vec<bytes::Bytes>>,
    subscribed: tokio::sync::oneshot::Sender<()>,
) {
    let mut subscribed = Some(subscribed);
    let mut warned = false;
    loop {
        let conn = match Zmtp::connect(&endpoint, "SUB", MAX_MESSAGE_BYTES, CONNECT_WAIT).await {
            Ok(mut c) => c.subscribe_all().await.map(|()| c),
            Err(e) => Err(e),
        };
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                if !warned {
                    tracing::warn!(%endpoint, error = %e, "cannot subscribe to the engine's KV events; retrying");
                    warned = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        warned = false;
        if let Some(s) = subscribed.take() {
            let _ = s.send(());
        }
        loop {
            match conn.recv().await {
                Ok(m) => {
                    if tx.send(m).await.is_err() {
                        return;
                    }
                }
                Err(ZmtpError::TooLarge(len)) => {
                    counter!(crate::metric_names::AGENT_KV_BATCHES_TOTAL, "result" => "too_large")
                        .increment(1);
                    tracing::warn!(%endpoint, len, "kv event frame over the bound; reconnecting");
                    break;
                }
                Err(e) => {
                    tracing::debug!(%endpoint, error = %e, "kv event connection ended; reconnecting");
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One engine's view and where its changes go.
struct View {
    engine: usize,
    ingest: Arc<Mutex<Ingest>>,
    residency: Arc<Mutex<Publisher>>,
    changed: Arc<tokio::sync::Notify>,
}

impl View {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ingest> {
        self.ingest.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `changes` a slice at a time: the publisher's lock is never held long
    /// enough to delay a heartbeat (a router takes 1.5 s of silence for a dead agent).
    fn report(&self, changes: Vec<Change>) {
        // How coarse residency is follows the pool's block size, once an engine told it.
        if let Some(bt) = self.lock().block_tokens() {
            self.residency
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .report_for_block_tokens(bt);
        }
        for part in changes.chunks(REPORT_CHUNK) {
            let mut r = self.residency.lock().unwrap_or_else(|p| p.into_inner());
            for c in part {
                r.record(*c);
            }
            drop(r);
            self.changed.notify_one();
        }
    }

    /// Drops the view and rebuilds it from every batch the engine's replay socket still
    /// keeps. `Some(last)`: done, `last` the last sequence applied (`None`: the engine
    /// keeps nothing); `None`: no replay socket, or it did not answer (try again).
    async fn resync(&self, replay: Option<&mut Replay>) -> Option<Option<u64>> {
        let batches = replay?.fetch(0, u64::MAX, RESYNC_WAIT).await?;
        let mut ingest = self.lock();
        let mut changes = ingest.reset(self.engine);
        for (s, b) in &batches {
            changes.extend(ingest.apply(self.engine, *s, b));
        }
        let last = ingest.last_seq(self.engine);
        let blocks = ingest.len(self.engine);
        drop(ingest);
        self.report(changes);
        counter!(crate::metric_names::AGENT_KV_RESYNCS_TOTAL).increment(1);
        tracing::info!(
            engine = self.engine,
            batches = batches.len(),
            blocks,
            "rebuilt the engine's view from its replay socket"
        );
        Some(last)
    }
}

/// The engine's replay socket (connected on first use; a failure drops the connection).
struct Replay {
    at: String,
    socket: Option<Zmtp>,
}

impl Replay {
    fn new(at: String) -> Self {
        Replay { at, socket: None }
    }

    /// The batches the engine still keeps from `from` to before `to`: the run of
    /// consecutive ones that starts with the first kept at or after `from` (the caller
    /// checks where it starts). `None` when the socket did not answer within `total`, or
    /// left [`REPLAY_WAIT`] between two messages.
    async fn fetch(&mut self, from: u64, to: u64, total: Duration) -> Option<Vec<(u64, Decoded)>> {
        if self.socket.is_none() {
            // The batch and its sequence, topic and envelope frames.
            match Zmtp::connect(&self.at, "DEALER", MAX_MESSAGE_BYTES + 4096, REPLAY_WAIT).await {
                Ok(s) => self.socket = Some(s),
                Err(e) => {
                    tracing::debug!(replay = %self.at, error = %e, "cannot connect to the engine's replay socket");
                    return None;
                }
            }
        }
        let socket = self.socket.as_mut()?;
        if socket.send(&[b"", &from.to_be_bytes()]).await.is_err() {
            self.socket = None;
            return None;
        }
        let deadline = Instant::now() + total;
        let mut got: Vec<(u64, Decoded)> = Vec::new();
        loop {
            let wait = deadline.min(Instant::now() + REPLAY_WAIT);
            let frames = match tokio::time::timeout_at(wait, socket.recv()).await {
                Ok(Ok(frames)) => frames,
                Ok(Err(ZmtpError::TooLarge(_))) => {
                    counter!(crate::metric_names::AGENT_KV_BATCHES_TOTAL, "result" => "too_large")
                        .increment(1);
                    self.socket = None;
                    return None;
                }
                // A late answer would be read as the next one's (and an abandoned read
                // leaves the stream mid-frame): start afresh next time.
                _ => {
                    self.socket = None;
                    return None;
                }
            };
            // `[empty, sequence, batch]` (vLLM to 0.25) or `[empty, topic, sequence, batch]`
            // (vLLM 0.26 on).
            let Some((seq, payload)) = crate::kv_events::parse_replay(&frames) else {
                self.socket = None;
                return None;
            };
            if payload.is_empty() {
                return Some(got); // the end marker
            }
            let next = got.last().map(|(s, _)| s + 1);
            if seq < from || seq >= to || next.is_some_and(|n| seq != n) {
                // Outside the range, or past a hole in what the engine keeps: the run
                // ends before it (the rest of the answer is read and dropped).
                continue;
            }
            if payload.len() > MAX_MESSAGE_BYTES {
                continue;
            }
            match decode_batch(payload) {
                Ok(b) => got.push((seq, b)),
                Err(_) => {
                    counter!(crate::metric_names::AGENT_KV_BATCHES_TOTAL, "result" => "malformed")
                        .increment(1);
                }
            }
        }
    }
}
