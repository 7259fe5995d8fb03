//! What the clients saw, in order: every operation with its invocation and completion
//! times and its outcome, and what the nemesis did when. Written as JSON lines, read back
//! by the checkers (which never look at anything else).

use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
// tokio's clock: real time in the harness, simulated time in the simulation test.
use tokio::time::Instant;

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum F {
    /// Linearizable read of the register tenant's value.
    Read,
    /// Blind write of a unique value to the register tenant.
    Write,
    /// Creates a tenant of its own (the set workload): id from `value`.
    Create,
    /// One routed completion through a router's data port.
    Route,
    /// One routed completion for the rate-limited tenant.
    Limited,
    /// A final read of every tenant a router serves (`value`: how many).
    FinalRead,
    /// A linearizable read of every tenant during the run (`seen`: the set's ids).
    SetRead,
}

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It took effect (a write) or observed `value` (a read).
    Ok,
    /// It surely did not take effect.
    Fail,
    /// It may or may not have taken effect (timeout, 504, connection lost).
    Info,
}

/// One client operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Op {
    pub process: usize,
    /// The router it was sent to (index).
    pub node: usize,
    pub f: F,
    /// The value written or created; for an ok read, the value seen (`None`: absent).
    pub value: Option<u64>,
    /// Milliseconds since the history began.
    pub invoke_ms: f64,
    pub complete_ms: f64,
    pub outcome: Outcome,
    /// HTTP status and message, or the transport error.
    pub detail: String,
    /// For final and set reads: every tenant id seen, sorted, and the config version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen: Option<(Vec<String>, u64)>,
}

/// What the nemesis did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fault {
    pub at_ms: f64,
    /// `start NAME targets`, `stop NAME`, or a note (a repair, a restart).
    pub what: String,
    /// The routers it touched.
    pub nodes: Vec<usize>,
    /// Whether this opens a fault (false: it ends one, or is a note).
    pub begins: bool,
}

/// One sample of each router's Raft status during the run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub at_ms: f64,
    pub node: usize,
    /// `None`: no answer.
    pub role: Option<String>,
    pub leader: Option<u64>,
    pub quorum_lost: bool,
    pub term: Option<u64>,
}

/// The whole record of one run.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct History {
    pub ops: Vec<Op>,
    pub faults: Vec<Fault>,
    pub status: Vec<Status>,
}

/// The recorder the clients and the nemesis share.
#[derive(Debug, Clone)]
pub struct Recorder {
    start: Instant,
    inner: Arc<Mutex<History>>,
}

impl Default for Recorder {
    fn default() -> Recorder {
        Recorder::new()
    }
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn new() -> Recorder {
        Recorder {
            start: Instant::now(),
            inner: Arc::default(),
        }
    }

    /// Milliseconds since the history began.
    pub fn now_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1e3
    }

    pub fn op(&self, op: Op) {
        self.inner.lock().expect("history lock").ops.push(op);
    }

    pub fn fault(&self, what: impl Into<String>, nodes: &[usize], begins: bool) {
        let f = Fault {
            at_ms: self.now_ms(),
            what: what.into(),
            nodes: nodes.to_vec(),
            begins,
        };
        println!("  {:>7.1} s  {}", f.at_ms / 1e3, f.what);
        self.inner.lock().expect("history lock").faults.push(f);
    }

    pub fn status(&self, s: Status) {
        self.inner.lock().expect("history lock").status.push(s);
    }

    /// The history so far, operations in invocation order.
    pub fn history(&self) -> History {
        let mut h = self.inner.lock().expect("history lock").clone();
        h.ops.sort_by(|a, b| a.invoke_ms.total_cmp(&b.invoke_ms));
        h
    }
}

impl History {
    /// JSON lines: one `{"op": …}`, `{"fault": …}` or `{"status": …}` per line.
    pub fn to_jsonl(&self) -> String {
        let mut out = String::new();
        let line = |out: &mut String, key: &str, v: serde_json::Value| {
            out.push_str(&serde_json::json!({ key: v }).to_string());
            out.push('\n');
        };
        for f in &self.faults {
            line(
                &mut out,
                "fault",
                serde_json::to_value(f).expect("serializable"),
            );
        }
        for o in &self.ops {
            line(
                &mut out,
                "op",
                serde_json::to_value(o).expect("serializable"),
            );
        }
        for s in &self.status {
            line(
                &mut out,
                "status",
                serde_json::to_value(s).expect("serializable"),
            );
        }
        out
    }

    /// Reads what [`History::to_jsonl`] wrote.
    pub fn from_jsonl(text: &str) -> anyhow::Result<History> {
        let mut h = History::default();
        for (i, l) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let mut v: serde_json::Value = serde_json::from_str(l)
                .map_err(|e| anyhow::anyhow!("history line {}: {e}", i + 1))?;
            let bad = || anyhow::anyhow!("history line {}: not an op, fault or status", i + 1);
            if let Some(o) = v.get_mut("op") {
                h.ops.push(serde_json::from_value(o.take())?);
            } else if let Some(f) = v.get_mut("fault") {
                h.faults.push(serde_json::from_value(f.take())?);
            } else if let Some(s) = v.get_mut("status") {
                h.status.push(serde_json::from_value(s.take())?);
            } else {
                return Err(bad());
            }
        }
        Ok(h)
    }
}
