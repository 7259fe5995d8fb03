//! One entry point per fuzz target (see `fuzz/`): each feeds arbitrary bytes to the
//! decoders that read one kind of network input, then hands what they accept to the code
//! that consumes it, and checks what must hold. The libFuzzer targets and the test that
//! replays the kept corpus (this module's tests, in `cargo test`) call these same functions.
//!
//! A target panics when a property fails; a decoder that refuses input returns an error,
//! which is the expected outcome for almost every fuzz input.

use crate::admin::api::{decode_body, decode_strict};
use crate::admin::wire::{ExplainInput, InstanceInput, KeyInput, TenantInput};
use crate::router::config::Tenant;
use crate::router::engines::kv_capacity_tokens;
use crate::router::proxy::{parse, with_cache_salt, Endpoint};
use crate::router::ratelimit::TokenBucket;
use crate::router::tenants::TenantTable;
use bytes::Bytes;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::EntryPayload;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use warmpath_index::keys::{token_block_keys, TenantKey};
use warmpath_index::policy::{PolicyConfig, RouteRequest, Strategy};
use warmpath_index::router::{CoreConfig, CorePool, InstanceSpec, RouterCore, SharedDecision};
use warmpath_index::text::Tokenizer;
use warmpath_membership::decisions::{instance_key, BatchWire};
use warmpath_membership::gossip::{DatagramGate, Rejected, MAC_KEY_CONTEXT};
use warmpath_membership::raft::state::{
    validate_tenant, Command, CommandResult, CommandV1, ConfigState, PoolSpec, TenantSpec,
};
use warmpath_membership::raft::store::{NodeId, TypeConfig};
use warmpath_membership::raft::wire::JoinRequest;
use warmpath_membership::schema::{decode_applied, decode_batch, decode_load, parse_decision_key};

/// A fuzz target: arbitrary bytes in, a panic when a property fails.
pub type Target = fn(&[u8]);

/// The fuzz targets by name: the names of `fuzz/fuzz_targets/*.rs` and `fuzz/corpus/*`.
pub const TARGETS: &[(&str, Target)] = &[
    ("openai_request", openai_request),
    ("engine_response", engine_response),
    ("admin_json", admin_json),
    ("raft_rpc", raft_rpc),
    ("gossip_datagram", gossip_datagram),
    ("decision_batch", decision_batch),
    ("agent_frame", agent_frame),
    ("kv_events", kv_events),
    ("residency_wire", residency_wire),
    ("zmtp_frames", zmtp_frames),
    ("lm_header", lm_header),
    ("hyperpod_request", hyperpod_request),
];

/// A client's completions or chat body, as the router parses, salts and forwards it.
pub fn openai_request(data: &[u8]) {
    const SALT: &str = "tenant-salt";
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let Ok(parsed) = parse(endpoint, data, |_| Tokenizer::builtin()) else {
            continue;
        };
        assert!(!parsed.tokens.is_empty(), "an accepted prompt has tokens");
        let Ok(salted) = with_cache_salt(&Bytes::copy_from_slice(data), SALT, parsed.own_salt)
        else {
            continue;
        };
        // What the engine reads must carry the tenant's salt exactly once, whatever the
        // client sent (a duplicate key is an error here; a JSON parser that keeps the last
        // one, as Python's does, would otherwise see the client's). The rest of the body is
        // the client's and is skipped unread: it may hold numbers beyond f64, which JSON
        // allows and Python reads as infinity.
        #[derive(serde::Deserialize)]
        struct Forwarded {
            cache_salt: String,
        }
        let engine: Forwarded = serde_json::from_slice(&salted)
            .expect("the forwarded body is a JSON object with one string cache_salt");
        let salt = engine.cache_salt.as_str();
        assert!(
            salt == SALT || salt.starts_with(&format!("{SALT}:")),
            "{salt:?}"
        );
        let again = parse(endpoint, &salted, |_| Tokenizer::builtin())
            .expect("the forwarded body parses as the original");
        assert_eq!(again.tokens, parsed.tokens);
        assert_eq!(again.model, parsed.model);
        assert_eq!(again.stream, parsed.stream);
    }
    // A dry run's body arrives inside an admin request.
    let _ = decode_body::<ExplainInput>(data, "explain request");
}

/// An engine's response (whole or streamed) and its `/metrics` text, as the router reads
/// them.
pub fn engine_response(data: &[u8]) {
    if let Some(usage) = warmpath_openai::cached_usage(data) {
        assert!(usage.cached_tokens().is_some());
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Some(tokens) = kv_capacity_tokens(text) {
            assert!(tokens > 0, "a capacity of zero tokens is no capacity");
        }
    }
}

/// Admin API bodies, applied to a configuration the way a committed write is, then
/// compiled into the router's tenant table.
pub fn admin_json(data: &[u8]) {
    let mut state = ConfigState::default();
    let pool = |model: &str| {
        Command::V1(CommandV1::PutPool {
            model: model.into(),
            spec: PoolSpec {
                instances: vec!["http://10.0.0.1:8000".into()],
                ..PoolSpec::default()
            },
            expected_version: None,
        })
    };
    assert!(matches!(
        state.apply(1, &pool("m")),
        CommandResult::Applied { .. }
    ));
    let mut commands = Vec::new();
    if let Ok(input) = decode_strict::<TenantInput>(data, "tenant") {
        if let Ok(spec) = input.into_spec("t") {
            commands.push(CommandV1::PutTenant {
                id: "t".into(),
                spec,
                expected_version: None,
            });
        }
    }
    if let Ok(spec) = decode_strict::<PoolSpec>(data, "pool") {
        commands.push(CommandV1::PutPool {
            model: "p".into(),
            spec,
            expected_version: None,
        });
    }
    if let Ok(input) = decode_body::<InstanceInput>(data, "instance") {
        commands.push(CommandV1::AddInstance {
            model: "m".into(),
            url: input.url,
            expected_version: None,
        });
    }
    if let Ok(input) = decode_body::<KeyInput>(data, "api key") {
        if warmpath_membership::raft::state::check_plain_key(&input.key).is_ok() {
            commands.push(CommandV1::AddApiKey {
                tenant: "t".into(),
                key_hash: warmpath_membership::raft::state::api_key_hash(&input.key),
                expected_version: None,
            });
        }
    }
    for (i, cmd) in commands.into_iter().enumerate() {
        apply_checked(&mut state, 2 + i as u64, &Command::V1(cmd));
    }
    serve(&state);
}

/// Peer RPC bodies and replies, as the Raft server and client decode them; the commands
/// an append carries are applied, and an installed snapshot is served.
pub fn raft_rpc(data: &[u8]) {
    if let Ok(rpc) = serde_json::from_slice::<AppendEntriesRequest<TypeConfig>>(data) {
        let mut state = ConfigState::default();
        for (i, entry) in rpc.entries.iter().enumerate() {
            if let EntryPayload::Normal(cmd) = &entry.payload {
                apply_checked(&mut state, 1 + i as u64, cmd);
            }
        }
        serve(&state);
    }
    if let Ok(cmd) = serde_json::from_slice::<Command>(data) {
        let mut state = ConfigState::default();
        apply_checked(&mut state, 1, &cmd);
    }
    if let Ok(snapshot) = serde_json::from_slice::<ConfigState>(data) {
        serve(&snapshot);
    }
    let _ = serde_json::from_slice::<VoteRequest<NodeId>>(data);
    let _ = serde_json::from_slice::<InstallSnapshotRequest<TypeConfig>>(data);
    let _ = serde_json::from_slice::<JoinRequest>(data);
    let _ = serde_json::from_slice::<AppendEntriesResponse<NodeId>>(data);
    let _ = serde_json::from_slice::<VoteResponse<NodeId>>(data);
    let _ = serde_json::from_slice::<InstallSnapshotResponse<NodeId>>(data);
}

/// Gossip datagrams through the gate every datagram passes before chitchat's own decoder
/// (which is chitchat's to fuzz, and only ever sees authenticated datagrams). The
/// first byte picks what the rest is: a raw datagram (which must be refused: it carries
/// no valid MAC), a message sealed with the cluster key (which must come out whole), or
/// fragments of one.
pub fn gossip_datagram(data: &[u8]) {
    let key = blake3::derive_key(MAC_KEY_CONTEXT, b"fuzz");
    let from = SocketAddr::from(([10, 0, 0, 1], 7946));
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut gate = DatagramGate::new(Some(key));
    let payload = match mode % 3 {
        0 => {
            let verdict = gate.accept(from, rest);
            assert!(
                matches!(verdict, Err(Rejected::Unauthenticated)),
                "a datagram without the key's MAC got {verdict:?}"
            );
            None
        }
        1 => {
            let frames = gate.seal(rest, u32::from(mode));
            let mut out = None;
            for frame in &frames {
                out = gate.accept(from, frame).ok().flatten().or(out);
            }
            out
        }
        _ => {
            // Authenticated fragments whose headers the fuzzer writes.
            let mut out = None;
            for part in rest.split(|&b| b == b'|') {
                let mut frame = b"WPF1".to_vec();
                frame.extend_from_slice(part);
                for sealed in gate.seal(&frame, 0) {
                    if let Ok(Some(whole)) = gate.accept(from, &sealed) {
                        out = Some(whole);
                    }
                }
            }
            out
        }
    };
    if mode % 3 == 1 && !rest.starts_with(b"WPF1") {
        // Sealed by the cluster key, and not a fragment: it comes out as it went in, when
        // it is a chitchat message.
        let is_chitchat = rest.starts_with(&45_139u16.to_le_bytes());
        assert_eq!(payload.as_deref(), is_chitchat.then_some(rest));
    }
    if let Some(payload) = payload {
        assert!(
            payload.starts_with(&45_139u16.to_le_bytes()),
            "only chitchat passes"
        );
    }
}

/// Gossiped key values: decision batches, loads and applied cursors, decoded as a router
/// decodes them and applied to a router core, which then routes with every strategy.
pub fn decision_batch(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = parse_decision_key(text);
    let _ = decode_applied(text);
    let urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"];
    let mut core = RouterCore::new(
        CoreConfig::default(),
        warmpath_index::profiles::builtin("default").expect("the default profile"),
    );
    core.set_pools(&[CorePool {
        model: "m".into(),
        instances: urls
            .iter()
            .map(|u| InstanceSpec {
                name: (*u).into(),
                key: instance_key(u),
            })
            .collect(),
        ..CorePool::default()
    }]);
    let mut prompt = Vec::new();
    if let Ok(BatchWire::V1 { decisions, .. }) = decode_batch(text) {
        let shared: Vec<SharedDecision> = decisions
            .iter()
            .map(|d| SharedDecision {
                instance: d.instance,
                keys: d.keys.clone(),
            })
            .collect();
        let unknown = core.apply_shared(&shared, 1_000);
        assert!(unknown <= shared.len());
        if let Some(d) = decisions.first() {
            prompt = d.keys.clone();
        }
    }
    if let Ok(load) = decode_load(text) {
        core.set_peer_loads(vec![("peer".into(), load.into_loads())]);
    }
    for (i, strategy) in Strategy::ALL.into_iter().enumerate() {
        let request = RouteRequest {
            keys: &prompt,
            prompt_tokens: (prompt.len() as u32).saturating_mul(16).max(1),
        };
        let policy = PolicyConfig::new(strategy, 16);
        let decision = core
            .route("t", &policy, "m", &request, &[], false, 2_000 + i as u64)
            .expect("a healthy pool always routes");
        core.finish(
            decision.instance,
            decision.uncached_tokens,
            false,
            decision.decided_at,
        );
    }
}

/// Applies `cmd` and checks the state machine's promises: a refused command changes
/// nothing, and an applied one leaves every stored tenant valid and on an existing pool.
fn apply_checked(state: &mut ConfigState, index: u64, cmd: &Command) {
    let before = state.clone();
    let replay = match cmd {
        Command::Once { key, .. } => before.recent_writes.iter().any(|w| w.key == *key),
        Command::V1(_) => false,
    };
    let result = state.apply(index, cmd);
    if replay {
        // A key seen before: its first answer (or a refusal, for another write), and
        // nothing changes.
        assert_eq!(
            *state, before,
            "a repeated key changed the state: {result:?}"
        );
        return;
    }
    // What a keyed write adds besides its effect: its key (not configuration).
    let configuration = |s: &ConfigState| (s.version, s.tenants.clone(), s.pools.clone());
    match result {
        CommandResult::Applied { version } => {
            assert_eq!(version, index);
            assert_eq!(state.version, index);
            for (id, spec) in &state.tenants {
                assert!(
                    validate_tenant(spec).is_empty(),
                    "stored tenant {id:?} is invalid: {:?}",
                    validate_tenant(spec)
                );
                assert!(
                    state.pools.contains_key(&spec.pool),
                    "tenant {id:?} has no pool"
                );
            }
        }
        _ => assert_eq!(
            configuration(state),
            configuration(&before),
            "a refused command changed the state"
        ),
    }
}

/// What the router does with a configuration: compiles the tenant table, admits a request
/// under each rate limit, and hashes a prompt with each tenant's block size.
fn serve(state: &ConfigState) {
    let tenants: Vec<(String, TenantSpec)> = state
        .tenants
        .iter()
        .map(|(id, spec)| (id.clone(), spec.clone()))
        .collect();
    let _table = TenantTable::new(
        &tenants,
        &[],
        tenants.first().map(|t| t.0.clone()),
        state.version,
    );
    let now = Instant::now();
    for (id, spec) in &tenants {
        let tenant = Tenant::compile(id, spec);
        if let Some(rps) = tenant.rate_limit_rps {
            let mut bucket = TokenBucket::new(rps);
            bucket.set_share(1.0 / 3.0);
            for _ in 0..3 {
                let _ = bucket.admit(now + Duration::from_millis(1));
            }
        }
        let key = TenantKey::derive(&tenant.id, &tenant.cache_salt);
        let tokens: Vec<u32> = (0..256).collect();
        let keys = token_block_keys(&key, &tokens, tenant.block_tokens as usize);
        assert!(keys.len() <= tokens.len());
    }
}

/// The cache-agent's network input: a handshake, a block API frame (a request as the agent
/// reads it, applied to a pure L1 store; a response as an engine's client reads it) and an
/// L2 object read back. The L1 bound and its accounting must hold whatever arrives, and an
/// L2 object that decodes must carry its own checksum.
pub fn agent_frame(data: &[u8]) {
    use warmpath_cache_agent::block::decode_object;
    use warmpath_cache_agent::l1::{own, L1};
    use warmpath_cache_agent::proto::{
        decode_body, decode_hello_prefix, frame_len, split_payloads, Request, Response,
    };
    use warmpath_tiers::{BlockId, Eviction};
    if let Ok(prefix) = <[u8; 8]>::try_from(data.get(..8).unwrap_or_default()) {
        if let Ok((_, len)) = decode_hello_prefix(&prefix) {
            assert!(len <= warmpath_cache_agent::proto::MAX_TOKEN_BYTES);
        }
    }
    if let Ok(prefix) = <[u8; 4]>::try_from(data.get(..4).unwrap_or_default()) {
        let _ = frame_len(prefix, 1 << 20);
    }
    let body = Bytes::copy_from_slice(data);
    let capacity = 4096;
    for policy in [Eviction::Lru, Eviction::S3Fifo] {
        let Ok(frame) = decode_body::<Request>(body.clone()) else {
            break;
        };
        let mut l1 = L1::new(capacity, policy);
        let mut evicted = Vec::new();
        match frame.header {
            Request::Put { layout, blocks } => {
                if let Ok(parts) = split_payloads(frame.payloads, blocks.iter().map(|b| b.bytes)) {
                    for (item, p) in blocks.iter().zip(parts).rev() {
                        let _ = l1.put(
                            BlockId::new(layout, item.key),
                            own(&p),
                            item.pin,
                            &mut evicted,
                        );
                    }
                }
            }
            Request::Lookup {
                layout,
                keys,
                lease_ms,
            } => {
                let ids: Vec<BlockId> = keys.iter().map(|&k| BlockId::new(layout, k)).collect();
                l1.touch_chain(&ids);
                let lease = l1.lease(&ids, 0, u64::from(lease_ms) * 1000);
                l1.release(lease);
            }
            Request::Get { layout, keys } | Request::GetSealed { layout, keys } => {
                for k in keys {
                    assert!(l1.get(&BlockId::new(layout, k)).is_none());
                }
            }
            // Its blocks are descriptors, which bytes cannot carry: decoding is what is fuzzed.
            Request::PutSealed { .. } => {}
            Request::Release { lease } => assert!(l1.release(lease).is_none()),
            Request::Unpin { layout, keys } => {
                for k in keys {
                    l1.unpin(&BlockId::new(layout, k));
                }
            }
            Request::Stats => {}
        }
        let stats = l1.stats();
        assert!(stats.bytes <= capacity);
        assert_eq!(stats.bytes, l1.payload_bytes());
    }
    if let Ok(frame) = decode_body::<Response>(body.clone()) {
        match frame.header {
            Response::Get { blocks } => {
                let lens = blocks.iter().flatten().map(|b| b.bytes);
                if let Ok(parts) = split_payloads(frame.payloads, lens) {
                    assert_eq!(parts.len(), blocks.iter().flatten().count());
                }
            }
            // Only the blocks not passed as descriptors have payloads in the frame.
            Response::GetSealed { blocks } => {
                let inline = blocks.iter().flatten().filter(|(_, sealed)| !sealed);
                let lens = inline.clone().map(|(b, _)| b.bytes);
                if let Ok(parts) = split_payloads(frame.payloads, lens) {
                    assert_eq!(parts.len(), inline.count());
                }
            }
            _ => {}
        }
    }
    let id = BlockId::new(1, 2);
    if let Ok(block) = decode_object(&id, body.clone()) {
        assert!(block.verify(), "a decoded L2 object matches its checksum");
    }
    // A sealed L2 object (decision 0106): whatever the bytes, only one sealed under the key
    // decodes, and what decodes matches its checksum.
    let key = warmpath_cache_agent::block::SealKey::from_secret(b"fuzzing cluster key");
    if let Ok((block, writer)) = warmpath_cache_agent::block::decode_with(&id, body, Some(&key)) {
        assert!(block.verify() && writer.is_some());
    }
    // A residency message as a router reads it, fed to a subscriber: whatever it says, the
    // subscriber's view stays what its outcomes applied.
    use warmpath_residency::{decode, Outcome, Subscriber, Wire};
    if let Some(msg) = decode(data).ok().and_then(Wire::into_msg) {
        let mut s = Subscriber::new(1_000);
        let mut view = std::collections::HashSet::new();
        for now in [0, 10] {
            let changes = match s.handle(now, msg.clone()) {
                Outcome::Apply { changes, .. } => changes,
                Outcome::Reset { removed, .. } => removed,
                Outcome::Nothing => Vec::new(),
            };
            for c in changes {
                if c.present {
                    view.insert((c.scope, c.key));
                } else {
                    view.remove(&(c.scope, c.key));
                }
            }
            assert_eq!(view.len(), s.len());
        }
    }
}

/// An engine's KV-event batch (vLLM's msgpack, either shape), as the agent decodes it: what
/// decodes must encode again, in both shapes, to the same events.
pub fn kv_events(data: &[u8]) {
    use warmpath_cache_agent::kv_events::{decode_batch, encode_batch, Shape};
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    for shape in [Shape::Array, Shape::Map] {
        let again = decode_batch(&encode_batch(batch.ts, &batch.events, shape))
            .expect("an encoded batch decodes");
        assert_eq!(again.events, batch.events, "{shape:?}");
        assert_eq!(again.unknown, 0);
    }
}

/// A residency message (postcard of `Wire`), as a router and an agent read it: what
/// decodes encodes again to the same message; a router's subscriber takes any agent's
/// message; an agent takes a tenant table within its bound and never an older version
/// after it (issue 26).
pub fn residency_wire(data: &[u8]) {
    use warmpath_cache_agent::ingest::{Ingest, TableRefused, Tenants};
    use warmpath_residency::{decode, encode, Reply, Subscriber, Wire, MAX_TENANT_ENTRIES};
    let Ok(wire) = decode(data) else {
        return;
    };
    assert_eq!(
        decode(&encode(&wire)).expect("an encoded message decodes"),
        wire
    );
    match wire {
        w @ (Wire::V1Msg(_) | Wire::V2Delta(_)) => {
            let m = w.into_msg().expect("an agent's message");
            let _ = Subscriber::new(1_000_000).handle(0, m);
        }
        Wire::V1Reply(Reply::TenantsAt { version, tenants }) => {
            let mut ingest = Ingest::new(Tenants::Fixed("t".into()), 1);
            let too_large = tenants.len() > MAX_TENANT_ENTRIES;
            match ingest.learn_tenants_at(version, tenants) {
                Err(TableRefused::TooLarge) => assert!(too_large),
                Err(TableRefused::Stale) => panic!("the first table is never stale"),
                Ok(_) if version > 0 => assert_eq!(
                    ingest.learn_tenants_at(version - 1, Vec::new()),
                    Err(TableRefused::Stale)
                ),
                Ok(_) => {}
            }
        }
        Wire::V1Reply(_) => {}
    }
}

/// What an engine's ZMQ socket sends after the handshake, as the agent's ZMTP client reads
/// it: every message it returns is within the bound in bytes and frames, and it ends
/// (an error) rather than read past what it was given.
pub fn zmtp_frames(data: &[u8]) {
    use warmpath_cache_agent::zmtp::{Zmtp, MAX_PARTS};
    const BOUND: usize = 4096;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let stream = tokio::io::join(data, tokio::io::sink());
        let mut z = Zmtp::after_handshake(stream, BOUND);
        while let Ok(m) = z.recv().await {
            assert!(m.len() <= MAX_PARTS, "{} frames", m.len());
            assert!(m.iter().map(|f| f.len()).sum::<usize>() <= BOUND);
        }
    });
}

/// An `lm://` client header (LMCache's `ClientMetaMessage`), as the agent's HyperPod store
/// reads it: what decodes has a known command, a length that fits, and a non-empty key of
/// text without control characters that encodes back to the same header.
pub fn lm_header(data: &[u8]) {
    use warmpath_cache_agent::hyperpod::lm::{decode_header, encode_header, HEADER_BYTES};
    let mut b = [b' '; HEADER_BYTES];
    let n = data.len().min(HEADER_BYTES);
    b[..n].copy_from_slice(&data[..n]);
    if let Ok(h) = decode_header(&b) {
        assert!(!h.key.is_empty() && !h.key.chars().any(char::is_control));
        assert!(i32::try_from(h.length).is_ok());
        assert_eq!(decode_header(&encode_header(&h)), Ok(h));
    }
}

/// A HyperPod API request line (method, then path and query) as the agent reads it, and a
/// lease id as it checks one: a key it accepts is text without control characters within
/// the bound, and percent-encoded as LMCache encodes keys it reads back the same; a lease
/// id it did not issue is never taken.
pub fn hyperpod_request(data: &[u8]) {
    use warmpath_cache_agent::hyperpod::request::{
        decode_key, encode_key, parse, LeaseIds, Op, MAX_KEY_BYTES,
    };
    let Some((&m, rest)) = data.split_first() else {
        return;
    };
    let method = ["PUT", "POST", "GET", "DELETE"][usize::from(m % 4)];
    let text = String::from_utf8_lossy(rest);
    let (path, query) = match text.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (&*text, None),
    };
    if let Ok(Op::Put(name) | Op::Lease { name, .. }) = parse(method, path, query) {
        assert!(!name.key.is_empty() && name.key.len() <= MAX_KEY_BYTES);
        assert!(!name.key.chars().any(char::is_control));
        assert_eq!(
            decode_key(&encode_key(&name.key)).as_deref(),
            Ok(&*name.key)
        );
    }
    let ids = LeaseIds::new(7, [9u8; 32]);
    if let Ok(lease) = ids.decode(&text) {
        assert_eq!(
            ids.encode(lease),
            text.to_ascii_lowercase(),
            "an id this run issued"
        );
    }
}

/// Starting inputs for each target, made from real values: what `fuzz/corpus` was seeded
/// with (`WARMPATH_WRITE_FUZZ_SEEDS=1 cargo test -p warmpath --lib fuzzing` writes them again).
pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    use openraft::{CommittedLeaderId, Entry, LogId, Vote};
    use warmpath_index::keys::BlockKey;
    use warmpath_membership::decisions::{encode, AppliedWire, Decision, LoadWire};
    let mut out: Vec<(&'static str, String, Vec<u8>)> = Vec::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        out.push((target, name.to_string(), bytes));
    };
    for (name, body) in [
        (
            "completion",
            r#"{"model":"m","prompt":"hello world","max_tokens":8,"stream":true}"#,
        ),
        (
            "token-ids",
            r#"{"model":"m","prompt":[[1,2,3,4]],"cache_salt":"mine"}"#,
        ),
        (
            "chat",
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:,"}}]}]}"#,
        ),
        (
            "tools",
            r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"42"}],"cache_salt":null}"#,
        ),
        (
            "explain",
            r#"{"tenant":"t","request":{"model":"m","prompt":"hi"}}"#,
        ),
    ] {
        add("openai_request", name, body.into());
    }
    for (name, body) in [
        ("usage", r#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"total_tokens":42,"prompt_tokens_details":{"cached_tokens":32}}}"#),
        ("sse", "data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1,\"total_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n"),
        ("metrics", "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"4096\"} 1.0\n"),
    ] {
        add("engine_response", name, body.into());
    }
    for (name, body) in [
        (
            "tenant",
            r#"{"pool":"m","strategy":"kv-aware","api_keys":["sk-a"],"rate_limit_rps":50,"block_tokens":16}"#,
        ),
        ("pool", r#"{"instances":["http://10.0.0.2:8000"]}"#),
        ("instance", r#"{"url":"http://10.0.0.3:8000"}"#),
        ("key", r#"{"key":"sk-b"}"#),
    ] {
        add("admin_json", name, body.into());
    }
    let put_tenant = Command::V1(CommandV1::PutTenant {
        id: "t".into(),
        spec: TenantSpec::with_defaults("t", "m"),
        expected_version: None,
    });
    let put_pool = Command::V1(CommandV1::PutPool {
        model: "m".into(),
        spec: PoolSpec {
            instances: vec!["http://10.0.0.1:8000".into()],
            ..PoolSpec::default()
        },
        expected_version: None,
    });
    let entry = |index: u64, cmd: Command| Entry::<TypeConfig> {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(cmd),
    };
    let append = AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(1, 1),
        prev_log_id: None,
        entries: vec![entry(1, put_pool.clone()), entry(2, put_tenant)],
        leader_commit: None,
    };
    let mut snapshot = ConfigState::default();
    snapshot.apply(1, &put_pool);
    fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
        serde_json::to_vec(v).expect("serializable")
    }
    {
        use warmpath_cache_agent::block::{encode_object, Block};
        use warmpath_cache_agent::proto::{
            encode_frame, encode_hello, GotBlock, PutItem, Request, Response, StoreTier,
        };
        use warmpath_tiers::BlockId;
        let frame = |o: warmpath_cache_agent::proto::Outgoing| {
            let mut v = o.head[4..].to_vec();
            for p in o.payloads {
                v.extend_from_slice(&p);
            }
            v
        };
        let put = Request::Put {
            layout: 1,
            blocks: vec![
                PutItem {
                    key: 1,
                    bytes: 3,
                    pin: false,
                },
                PutItem {
                    key: 2,
                    bytes: 2,
                    pin: true,
                },
            ],
        };
        let payloads = vec![Bytes::from_static(b"abc"), Bytes::from_static(b"de")];
        add("agent_frame", "put", frame(encode_frame(1, &put, payloads)));
        let lookup = Request::Lookup {
            layout: 1,
            keys: vec![1, 2, 3],
            lease_ms: 100,
        };
        add(
            "agent_frame",
            "lookup",
            frame(encode_frame(2, &lookup, Vec::new())),
        );
        let got = Response::Get {
            blocks: vec![
                Some(GotBlock {
                    bytes: 3,
                    checksum: 0,
                    tier: StoreTier::L2,
                }),
                None,
            ],
        };
        add(
            "agent_frame",
            "get-answer",
            frame(encode_frame(3, &got, vec![Bytes::from_static(b"abc")])),
        );
        let put_sealed = Request::PutSealed {
            layout: 1,
            blocks: vec![PutItem {
                key: 4,
                bytes: 65536,
                pin: false,
            }],
        };
        add(
            "agent_frame",
            "put-sealed",
            frame(encode_frame(4, &put_sealed, Vec::new())),
        );
        let got_sealed = Response::GetSealed {
            blocks: vec![
                Some((
                    GotBlock {
                        bytes: 65536,
                        checksum: 0,
                        tier: StoreTier::L1,
                    },
                    true,
                )),
                Some((
                    GotBlock {
                        bytes: 2,
                        checksum: 9,
                        tier: StoreTier::L2,
                    },
                    false,
                )),
                None,
            ],
        };
        add(
            "agent_frame",
            "get-sealed-answer",
            frame(encode_frame(
                5,
                &got_sealed,
                vec![Bytes::from_static(b"de")],
            )),
        );
        add(
            "agent_frame",
            "hello",
            encode_hello(b"token").unwrap_or_default(),
        );
        let object = encode_object(&BlockId::new(1, 2), &Block::new(Bytes::from_static(b"kv")));
        add("agent_frame", "l2-object", object.to_vec());
        let sealed = warmpath_cache_agent::block::encode_sealed(
            &BlockId::new(1, 2),
            &Block::new(Bytes::from_static(b"kv")),
            &warmpath_cache_agent::block::SealKey::from_secret(b"fuzzing cluster key"),
            7,
        );
        add("agent_frame", "l2-object-sealed", sealed.to_vec());
        use warmpath_residency::{encode, Change, Msg, Scope, Wire};
        let snapshot = Msg::Snapshot {
            epoch: 1,
            seq: 0,
            instances: vec!["http://e0".into()],
            blocks: vec![(Scope::Gpu(0), 7, None), (Scope::L1, 8, Some(7))],
            last: true,
        };
        add(
            "agent_frame",
            "residency-snapshot",
            encode(&Wire::V1Msg(snapshot)),
        );
        let delta = Msg::Delta {
            epoch: 1,
            seq: 1,
            sent_ms: 0,
            changes: vec![Change {
                scope: Scope::L2,
                key: 9,
                parent: None,
                present: true,
            }],
        };
        add(
            "agent_frame",
            "residency-delta",
            encode(&Wire::V1Msg(delta)),
        );
    }
    {
        use warmpath_cache_agent::kv_events::{encode_batch, EngineHash, KvEvent, Shape};
        let events = vec![
            KvEvent::Stored {
                block_hashes: vec![
                    EngineHash(1u64.to_be_bytes().to_vec()),
                    EngineHash(vec![9; 32]),
                ],
                parent: None,
                token_ids: (0..32).collect(),
                block_size: 16,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: vec![vec!["salt".into()], vec![]],
            },
            KvEvent::Removed {
                block_hashes: vec![EngineHash(vec![9; 32])],
                medium: Some("GPU".into()),
            },
            KvEvent::Cleared,
        ];
        add(
            "kv_events",
            "array",
            encode_batch(1.5, &events, Shape::Array),
        );
        add("kv_events", "map", encode_batch(1.5, &events, Shape::Map));
    }
    add("raft_rpc", "append", json(&append));
    add(
        "raft_rpc",
        "vote",
        json(&VoteRequest::<NodeId>::new(Vote::new(2, 2), None)),
    );
    add("raft_rpc", "command", json(&put_pool));
    add("raft_rpc", "snapshot", json(&snapshot));
    add(
        "raft_rpc",
        "join",
        json(&JoinRequest {
            node_id: 4,
            url: "http://10.0.0.4:9090".into(),
        }),
    );
    let magic = 45_139u16.to_le_bytes();
    add(
        "gossip_datagram",
        "raw",
        [&[0u8][..], &magic, b"\x05\x00syn"].concat(),
    );
    add(
        "gossip_datagram",
        "sealed",
        [&[1u8][..], &magic, b"\x05\x00syn"].concat(),
    );
    add(
        "gossip_datagram",
        "fragments",
        [
            &[2u8][..],
            b"\x07\0\0\0\x00\x02",
            &magic,
            b"ab|\x07\0\0\0\x01\x02cd",
        ]
        .concat(),
    );
    let batch = BatchWire::V1 {
        made_at_ms: 1,
        decisions: vec![Decision {
            instance: instance_key("http://10.0.0.1:8000"),
            keys: vec![BlockKey(1), BlockKey(2), BlockKey(3)],
        }],
    };
    add("decision_batch", "batch", encode(&batch).into_bytes());
    add(
        "decision_batch",
        "load",
        encode(&LoadWire::V1 {
            entries: vec![(instance_key("http://10.0.0.2:8000"), 3, 4096)],
        })
        .into_bytes(),
    );
    add(
        "decision_batch",
        "applied",
        encode(&AppliedWire::V1 {
            applied: vec![("r1:7".into(), 12)],
        })
        .into_bytes(),
    );
    add("decision_batch", "key", b"d:00000000000000000042".to_vec());
    {
        use warmpath_residency::{Change, Msg, Reply, Scope, Wire};
        let wire = |w: Wire| warmpath_residency::encode(&w);
        add(
            "residency_wire",
            "resync",
            wire(Wire::V1Reply(Reply::Resync)),
        );
        add(
            "residency_wire",
            "tenants",
            wire(Wire::V1Reply(Reply::Tenants(vec![(
                "s".into(),
                "t".into(),
            )]))),
        );
        add(
            "residency_wire",
            "tenants-at",
            wire(Wire::V1Reply(Reply::TenantsAt {
                version: 12,
                tenants: vec![("s".into(), "t".into()), ("u".into(), "v".into())],
            })),
        );
        add(
            "residency_wire",
            "delta",
            wire(Wire::V1Msg(Msg::Delta {
                epoch: 1,
                seq: 1,
                sent_ms: 5,
                changes: vec![Change {
                    scope: Scope::Gpu(0),
                    key: 7,
                    parent: Some(6),
                    present: true,
                }],
            })),
        );
        add(
            "residency_wire",
            "delta-v2",
            wire(Wire::for_link(
                Msg::Delta {
                    epoch: 1,
                    seq: 2,
                    sent_ms: 5,
                    changes: vec![
                        Change {
                            scope: Scope::Gpu(0),
                            key: 7,
                            parent: None,
                            present: true,
                        },
                        Change {
                            scope: Scope::L1,
                            key: u64::MAX,
                            parent: None,
                            present: false,
                        },
                    ],
                },
                2,
            )),
        );
        // vLLM's three frames (topic, sequence, batch), a long frame, then a command.
        let mut zmtp = vec![1, 5];
        zmtp.extend_from_slice(b"kv@e0");
        zmtp.extend_from_slice(&[1, 8, 0, 0, 0, 0, 0, 0, 0, 7]);
        zmtp.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 1, 0]);
        zmtp.extend_from_slice(&[0x90; 256]);
        zmtp.extend_from_slice(&[4, 5]);
        zmtp.extend_from_slice(b"\x04PING");
        add("zmtp_frames", "messages", zmtp);

        add(
            "residency_wire",
            "snapshot",
            wire(Wire::V1Msg(Msg::Snapshot {
                epoch: 1,
                seq: 0,
                instances: vec!["http://10.0.0.1:8000".into()],
                blocks: vec![(Scope::L1, 7, None)],
                last: true,
            })),
        );
    }
    {
        use warmpath_cache_agent::hyperpod::lm::{encode_header, Command, Header};
        use warmpath_cache_agent::hyperpod::request::Meta;
        let h = Header {
            command: Command::Put,
            length: 1 << 20,
            meta: Meta {
                fmt: 1,
                dtype: 3,
                shape: [2, 2, 256, 1024],
            },
            key: "meta-llama/Llama-3-8B@1@0@-5a1f@bfloat16".into(),
        };
        add("lm_header", "put", encode_header(&h).to_vec());
        let get = Header {
            command: Command::Get,
            length: 0,
            ..h
        };
        add("lm_header", "get", encode_header(&get).to_vec());
        let mut put = vec![0u8];
        put.extend_from_slice(b"/v1/kv/lmcache/meta-llama%2FLlama-3-8B@1@0@-5a1f@bfloat16");
        add("hyperpod_request", "put", put);
        let mut lease = vec![1u8];
        lease.extend_from_slice(
            b"/v1/kv/lmcache/m@1@0@1234abcd@half/leases?timeout_ms=2000&ttl_s=10.0",
        );
        add("hyperpod_request", "lease", lease);
        let mut release = vec![1u8];
        release.extend_from_slice(
            format!(
                "/v1/leases/{}/release",
                warmpath_cache_agent::hyperpod::request::LeaseIds::new(7, [9u8; 32]).encode(3)
            )
            .as_bytes(),
        );
        add("hyperpod_request", "release", release);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn corpus() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus")
    }

    /// Every kept corpus input and every seed, through its target: the fuzzers' findings,
    /// once fixed, stay fixed without a fuzzer.
    #[test]
    fn the_kept_corpus_passes_every_target() {
        for (target, name, bytes) in seeds() {
            let run = TARGETS
                .iter()
                .find(|(t, _)| *t == target)
                .expect("known target");
            let outcome = std::panic::catch_unwind(|| (run.1)(&bytes));
            assert!(outcome.is_ok(), "seed {target}/{name} failed");
        }
        let mut replayed = 0;
        for (target, run) in TARGETS {
            let dir = corpus().join(target);
            let entries =
                std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            for entry in entries {
                let path = entry.expect("a directory entry").path();
                let bytes = std::fs::read(&path).expect("a corpus file");
                let outcome = std::panic::catch_unwind(|| run(&bytes));
                assert!(outcome.is_ok(), "{} failed", path.display());
                replayed += 1;
            }
        }
        assert!(replayed >= seeds().len(), "only {replayed} corpus inputs");
    }

    /// The kept corpus holds every seed as `seeds()` makes it today, so a changed wire
    /// format cannot leave the corpus seeded with stale bytes.
    /// `WARMPATH_WRITE_FUZZ_SEEDS=1 cargo test -p warmpath --lib fuzzing` writes them first.
    #[test]
    fn the_corpus_holds_every_seed() {
        let write = std::env::var_os("WARMPATH_WRITE_FUZZ_SEEDS").is_some();
        for (target, name, bytes) in seeds() {
            let path = corpus().join(target).join(format!("seed-{name}"));
            if write {
                std::fs::create_dir_all(path.parent().expect("a corpus dir")).expect("corpus dir");
                std::fs::write(&path, &bytes).expect("seed written");
            }
            let kept = std::fs::read(&path).unwrap_or_default();
            assert!(
                kept == bytes,
                "{} is missing or stale: WARMPATH_WRITE_FUZZ_SEEDS=1 cargo test -p warmpath --lib fuzzing",
                path.display()
            );
        }
    }
}
