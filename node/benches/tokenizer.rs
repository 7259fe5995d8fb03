//! What a real tokenizer adds to a router's latency: the same requests sent straight to an
//! engine-sim, through a router whose pool uses the built-in tokenizer, and through one
//! whose pool names `tiktoken:o200k_base`, interleaved in one run so all see the same
//! machine noise; for a 4 KB and a 32 KB prompt. Also the tokenizers alone, in process.
//!
//! Run with `cargo bench -p warmpath --bench tokenizer`. Real processes on loopback: one
//! engine-sim with a huge speed-up (the engine's own time near zero) and two routers. Each
//! request is a non-streaming completion with one output token; prompts are pseudo-words
//! (a shared prefix and a unique tail), which BPE splits into more pieces than English.

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
mod common;

use common::{cpu_seconds, percentile, scrape, send_completion, start, value};
use std::time::{Duration, Instant};
use warmpath_index::text::Tokenize;

const PAIRS: usize = 1500;
const WARMUP: usize = 100;

/// A prompt of about `bytes` bytes: a prefix shared by all, then a tail unique to `i`.
fn prompt(bytes: usize, i: usize) -> String {
    let prefix = warmpath_index::text::words(1, bytes / 8);
    let mut p = format!(
        "{prefix}{}",
        warmpath_index::text::words(1000 + i as u64, 40)
    );
    while p.len() < bytes {
        p.push_str(&warmpath_index::text::words(2000 + i as u64, 40));
    }
    let mut end = bytes;
    while !p.is_char_boundary(end) {
        end -= 1;
    }
    p.truncate(end);
    p
}

/// A router's own timings, from its metrics: totals, or means over an interval.
struct Inside {
    tokenize_us: f64,
    overhead_us: f64,
    count: f64,
}

impl Inside {
    fn of(url: &str) -> Inside {
        let m = scrape(url);
        Inside {
            tokenize_us: value(&m, "warmpath_router_tokenize_seconds_sum") * 1e6,
            overhead_us: value(&m, "warmpath_router_overhead_seconds_sum") * 1e6,
            count: value(&m, "warmpath_router_overhead_seconds_count"),
        }
    }

    /// Means per request since `before`.
    fn since(&self, before: &Inside) -> Inside {
        let n = self.count - before.count;
        Inside {
            tokenize_us: (self.tokenize_us - before.tokenize_us) / n,
            overhead_us: (self.overhead_us - before.overhead_us) / n,
            count: n,
        }
    }
}

/// o200k written as a Hugging Face `tokenizer.json` (byte-level BPE with o200k's pattern,
/// vocabulary and, for each token, every pair of lower-ranked tokens that forms it, in
/// rank order): a stand-in for the tokenizer.json of a real model of that size, which this
/// machine cannot download. Its ids are compared with o200k's before it is timed.
fn o200k_as_hugging_face() -> String {
    let bpe = &bpe_openai::o200k_base().bpe;
    let spell = |bytes: &[u8]| -> String {
        bytes
            .iter()
            .map(|&b| warmpath::prompt::byte_level_char(b))
            .collect()
    };
    let n = bpe.num_tokens() as u32;
    let ids: std::collections::HashMap<&[u8], u32> =
        (0..n).map(|id| (bpe.token_bytes(id), id)).collect();
    let mut vocab = serde_json::Map::new();
    let mut merges = Vec::new();
    for id in 0..n {
        let bytes = bpe.token_bytes(id);
        vocab.insert(spell(bytes), serde_json::json!(id));
        for cut in 1..bytes.len() {
            let (a, b) = (ids.get(&bytes[..cut]), ids.get(&bytes[cut..]));
            if let (Some(&a), Some(&b)) = (a, b) {
                if a < id && b < id {
                    merges.push(serde_json::json!([
                        spell(&bytes[..cut]),
                        spell(&bytes[cut..])
                    ]));
                }
            }
        }
    }
    let pattern = warmpath::pretokenize::O200K_REGEX;
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
    .to_string()
}

fn main() {
    let engine = start(
        &[
            "engine-sim",
            "--listen",
            "127.0.0.1:0",
            "--speedup",
            "1000000",
        ],
        1,
    );
    let dir = tempfile::tempdir().expect("a temp dir");
    // A router whose one pool names `tokenizer`.
    let router_with = |name: &str, tokenizer: &str| {
        let config = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{}\"]\ntokenizer = \"{tokenizer}\"\n",
                engine.url
            ),
        )
        .expect("config written");
        let config = config.to_str().expect("utf-8 path").to_string();
        start(
            &["router", "--listen", "127.0.0.1:0", "--config", &config],
            1,
        )
    };
    let builtin = start(
        &[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--instance",
            &engine.url,
        ],
        1,
    );
    let o200k = router_with("o200k", "tiktoken:o200k_base");
    let hf_path = dir.path().join("o200k-hf.json");
    std::fs::write(&hf_path, o200k_as_hugging_face()).expect("tokenizer.json written");
    let hf = router_with("hf", &format!("hf:{}", hf_path.display()));
    let under = [
        ("builtin", builtin.url.clone(), builtin.child.id()),
        ("o200k", o200k.url.clone(), o200k.child.id()),
        ("hf-o200k", hf.url.clone(), hf.child.id()),
    ];
    println!(
        "router added latency by tokenizer: {PAIRS} interleaved rounds after {WARMUP} warm-up rounds per prompt size, 1 output token, one connection each; machine: {} cores, shared by client, routers and engine-sim",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    // The tokenizers alone, in this process (median of 200 calls).
    let o200k_text = warmpath::prompt::PoolText::load("tiktoken:o200k_base", "").expect("o200k");
    let hf_text = warmpath::prompt::PoolText::load(&format!("hf:{}", hf_path.display()), "")
        .expect("the converted tokenizer.json loads");
    for size in [4096usize, 32768] {
        let p = prompt(size, 7);
        let time = |f: &dyn Fn() -> usize| {
            let mut t: Vec<f64> = (0..200)
                .map(|_| {
                    let s = Instant::now();
                    std::hint::black_box(f());
                    s.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            t.sort_by(f64::total_cmp);
            percentile(&t, 0.5)
        };
        let (nb, no) = (
            warmpath_index::text::tokenize(&p).len(),
            o200k_text.completion(&p).len(),
        );
        // A cold piece cache: each call on a thread of its own (the cache is per thread).
        let mut cold: Vec<f64> = (0..50)
            .map(|_| {
                std::thread::scope(|s| {
                    s.spawn(|| {
                        let t = Instant::now();
                        std::hint::black_box(o200k_text.completion(&p));
                        t.elapsed().as_secs_f64() * 1e6
                    })
                    .join()
                    .expect("a timing thread")
                })
            })
            .collect();
        cold.sort_by(f64::total_cmp);
        let uncached = time(&|| bpe_openai::o200k_base().encode(p.as_str()).len());
        let same = hf_text.completion(&p) == o200k_text.completion(&p);
        println!(
            "  tokenizer alone, {} KB: builtin {:.1} µs ({nb} tokens); o200k {:.1} µs warm piece cache, {:.1} µs cold, {uncached:.1} µs without the cache ({no} tokens); o200k as a Hugging Face tokenizer.json {:.1} µs (ids equal to o200k's: {same})",
            size / 1024,
            time(&|| warmpath_index::text::tokenize(&p).len()),
            time(&|| o200k_text.completion(&p).len()),
            percentile(&cold, 0.5),
            time(&|| hf_text.completion(&p).len()),
        );
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new());
        for size in [4096usize, 32768] {
            let make = |i: usize| {
                Bytes::from(
                    serde_json::json!({"model": "sim-llama", "prompt": prompt(size, i), "max_tokens": 1})
                        .to_string(),
                )
            };
            for i in 0..WARMUP {
                let body = make(i);
                send_completion(&client, &engine.url, &body).await;
                for (_, url, _) in &under {
                    send_completion(&client, url, &body).await;
                }
            }
            let cpu0: Vec<f64> = under.iter().map(|u| cpu_seconds(u.2)).collect();
            let inside0: Vec<Inside> = under.iter().map(|u| Inside::of(&u.1)).collect();
            let mut direct = Vec::new();
            let mut diff: Vec<Vec<f64>> = vec![Vec::new(); under.len()];
            for i in 0..PAIRS {
                let body = make(WARMUP + i);
                let n = under.len() + 1;
                let mut times = vec![Duration::ZERO; n];
                // Rotate which goes first, so none always warms another's path.
                for k in 0..n {
                    let who = (i + k) % n;
                    let url = if who == 0 {
                        &engine.url
                    } else {
                        &under[who - 1].1
                    };
                    times[who] = send_completion(&client, url, &body).await;
                }
                let d = times[0].as_secs_f64() * 1e6;
                direct.push(d);
                for (j, t) in times[1..].iter().enumerate() {
                    diff[j].push(t.as_secs_f64() * 1e6 - d);
                }
            }
            let cpu: Vec<f64> = under
                .iter()
                .zip(&cpu0)
                .map(|(u, c0)| (cpu_seconds(u.2) - c0) * 1e6 / PAIRS as f64)
                .collect();
            let inside: Vec<Inside> = under
                .iter()
                .zip(&inside0)
                .map(|(u, i0)| Inside::of(&u.1).since(i0))
                .collect();
            direct.sort_by(f64::total_cmp);
            println!(
                "  {} KB prompt: direct to engine-sim p50 {:.1} µs, p99 {:.1} µs",
                size / 1024,
                percentile(&direct, 0.5),
                percentile(&direct, 0.99)
            );
            for (j, (name, _, _)) in under.iter().enumerate() {
                diff[j].sort_by(f64::total_cmp);
                println!(
                    "    added by the router, {name:<8} p50 {:7.1} µs  p99 {:7.1} µs; inside the router, mean: parse and tokenize {:5.1} µs, arrival to upstream send {:5.1} µs; router CPU {:5.1} µs per request",
                    percentile(&diff[j], 0.5),
                    percentile(&diff[j], 0.99),
                    inside[j].tokenize_us,
                    inside[j].overhead_us,
                    cpu[j]
                );
            }
        }
        println!("  (DESIGN.md's target, for a 4 KB prompt: added p50 < 100 µs, p99 < 500 µs)");
    });
}
