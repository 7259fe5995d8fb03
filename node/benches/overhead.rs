//! Router overhead: the same requests sent straight to an engine-sim and through each router
//! (and a plain nginx proxy hop) in front of it, interleaved in one run, so all see the same
//! machine noise.
//!
//! Run with `cargo bench -p warmpath --bench overhead`. It starts real processes on
//! loopback: one engine-sim with a huge speed-up (so the engine's own time is near zero and
//! what remains is HTTP, parsing and tokenizing), and in front of it:
//! - warmpath prefix-aware with the built-in tokenizer, and with `tiktoken:o200k_base`;
//! - nginx as a plain reverse proxy with upstream keep-alive (the floor a proxy hop costs),
//!   when an `nginx` binary is found (`WARMPATH_BENCH_NGINX`, else `nginx` on the `PATH` or
//!   `/usr/sbin/nginx`);
//! - the peers installed in a Python (`WARMPATH_BENCH_PEER_PYTHON`, else the venv that
//!   `bench/peers.py --install` makes at `target/peer-venv`): SMG (`smg launch --policy
//!   cache_aware --disable-tokenizer-autoload`), sglang-router (`--policy cache_aware`) and
//!   vllm-router (its default policy). A peer that is not installed is named and skipped.
//!
//! Each request is a non-streaming completion with one output token. For each prompt size
//! (`WARMPATH_BENCH_SIZES`, default `1024,4096,32768` bytes): c=1, interleaved rounds
//! (`WARMPATH_BENCH_PAIRS`, default 2,000, after 200 warm-up rounds; which target goes first
//! rotates) giving latency p50/p99 direct and through each, and the added latency (p50 and
//! p99 of the per-request differences); then c=16, closed loop for `WARMPATH_BENCH_SECONDS`
//! (default 6, in 3 rounds with the targets in rotation; the median round) per target:
//! saturated throughput, the target's CPU seconds, its resident
//! memory afterwards. The end lists issue 28's targets against what was measured.

use bytes::Bytes;
mod common;

use common::{percentile, send_completion, start, HttpClient};
use std::time::{Duration, Instant};

const WARMUP: usize = 200;
const CLIENTS: usize = 16;
/// Closed-loop rounds per target and size, the targets in rotation: a neighbour's burst on
/// this shared machine then lands in one round of one target, not in a target's whole run.
const SATURATED_ROUNDS: usize = 3;

/// A target under test: its name, URL and process id.
struct Under {
    name: String,
    url: String,
    pid: u32,
    /// Ours (its added latency is held to the targets), and with which tokenizer.
    ours: Option<&'static str>,
}

/// The processes started here that are not `warmpath` (nginx, the peers), stopped on any
/// exit, a panic included.
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            // nginx's master stops its workers on TERM (on KILL they would linger).
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        std::thread::sleep(Duration::from_millis(200));
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One target's figures at one prompt size.
#[derive(Clone, Copy, Default)]
struct Figures {
    added_p50: f64,
    added_p99: f64,
    rate: f64,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn peer_python() -> String {
    std::env::var("WARMPATH_BENCH_PEER_PYTHON").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/peer-venv/bin/python"
        )
        .to_string()
    })
}

/// Starts a peer router from `python` when its `module` imports, on a free port.
fn start_peer(
    python: &str,
    module: &str,
    args: &[&str],
    engine: &str,
) -> Option<(std::process::Child, String)> {
    let has = std::process::Command::new(python)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        println!("({module} not measured: not installed in {python}; run bench/peers.py --install, or pip install it there)");
        return None;
    }
    let port = common::free_addr().port().to_string();
    // Each peer exports Prometheus metrics on a port of its own (they share a default).
    let metrics_port = common::free_addr().port().to_string();
    let child = std::process::Command::new(python)
        .args(args)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--worker-urls",
            engine,
        ])
        .args([
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &metrics_port,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    Some((child, format!("http://127.0.0.1:{port}")))
}

/// nginx as a plain reverse proxy to `engine`, keeping upstream connections alive.
fn start_nginx(engine: &str, dir: &std::path::Path) -> Option<(std::process::Child, String)> {
    let nginx = std::env::var("WARMPATH_BENCH_NGINX").ok().or_else(|| {
        ["/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"]
            .iter()
            .find(|p| std::path::Path::new(p).exists())
            .map(|p| p.to_string())
    });
    let Some(nginx) = nginx else {
        println!("(nginx not measured: no nginx binary; set WARMPATH_BENCH_NGINX)");
        return None;
    };
    let port = common::free_addr().port();
    let upstream = engine.trim_start_matches("http://");
    let d = dir.display();
    let conf = format!(
        "worker_processes auto;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log error;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
           upstream engine {{ server {upstream}; keepalive 64; }}\n\
           server {{\n    listen 127.0.0.1:{port};\n    client_max_body_size 4m;\n    client_body_buffer_size 128k;\n\
             location / {{ proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection \"\"; }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).expect("nginx.conf written");
    let child = std::process::Command::new(nginx)
        .args(["-e", &format!("{d}/nginx-error.log"), "-p", &d.to_string()])
        .args([
            "-c",
            path.to_str().expect("utf-8 path"),
            "-g",
            "daemon off;",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    Some((child, format!("http://127.0.0.1:{port}")))
}

/// Resident memory of `pid` and its children, MiB (Linux).
fn rss_mib(pid: u32) -> f64 {
    family(pid)
        .iter()
        .map(|p| {
            std::fs::read_to_string(format!("/proc/{p}/status"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        })
        .sum::<f64>()
        / 1024.0
}

/// `pid` and its direct children (nginx's workers, a Python launcher's router).
fn family(pid: u32) -> Vec<String> {
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    std::iter::once(pid.to_string())
        .chain(children.split_whitespace().map(str::to_string))
        .collect()
}

/// CPU seconds `pid` and its direct children have used.
fn cpu_seconds(pid: u32) -> f64 {
    family(pid)
        .iter()
        .filter_map(|p| p.parse().ok())
        .map(common::cpu_seconds)
        .sum()
}

/// A completion body with a prompt of `size` bytes: a prefix shared across requests and a
/// unique tail.
fn body(prefix: &str, size: usize, i: usize) -> Bytes {
    let prompt = format!(
        "{prefix}{}",
        warmpath_index::text::words(1_000 + i as u64, 40)
    );
    let prompt = &prompt[..prompt.len().min(size)];
    Bytes::from(
        serde_json::json!({"model": "sim-llama", "prompt": prompt, "max_tokens": 1}).to_string(),
    )
}

/// Whether `u` serves a completion within 90 s.
async fn wait_up(client: &HttpClient, u: &Under, sample: &Bytes) -> bool {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let req = hyper::Request::post(format!("{}/v1/completions", u.url))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(sample.clone()))
            .expect("valid request");
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(2), client.request(req)).await {
            if r.status().is_success() {
                return true;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::var("WARMPATH_BENCH_SIZES")
        .unwrap_or_else(|_| "1024,4096,32768".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let pairs: usize = env_or("WARMPATH_BENCH_PAIRS", 2_000);
    let seconds: f64 = env_or("WARMPATH_BENCH_SECONDS", 6.0);
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
    let builtin = start(
        &[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--instance",
            &engine.url,
            "--strategy",
            "prefix-aware",
        ],
        1,
    );
    let o200k_config = dir.path().join("o200k.toml");
    std::fs::write(
        &o200k_config,
        format!(
            "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{}\"]\ntokenizer = \"tiktoken:o200k_base\"\n",
            engine.url
        ),
    )
    .expect("config written");
    let o200k = start(
        &[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--config",
            o200k_config.to_str().expect("utf-8 path"),
            "--strategy",
            "prefix-aware",
        ],
        1,
    );
    let mut under = vec![
        Under {
            name: "warmpath prefix-aware".into(),
            url: builtin.url.clone(),
            pid: builtin.child.id(),
            ours: Some("builtin"),
        },
        Under {
            name: "warmpath o200k".into(),
            url: o200k.url.clone(),
            pid: o200k.child.id(),
            ours: Some("o200k"),
        },
    ];
    // A second warmpath binary (`WARMPATH_BENCH_BASELINE`, e.g. a build of the previous
    // commit), built-in tokenizer: before and after a change side by side in one run.
    let baseline = std::env::var("WARMPATH_BENCH_BASELINE").ok().map(|bin| {
        let mut command = std::process::Command::new(bin);
        command.args([
            "router",
            "--listen",
            "127.0.0.1:0",
            "--instance",
            &engine.url,
            "--strategy",
            "prefix-aware",
        ]);
        common::Proc::try_spawn(&mut command, 1, "error").expect("the baseline router starts")
    });
    if let Some(b) = &baseline {
        under.push(Under {
            name: "warmpath baseline".into(),
            url: b.url.clone(),
            pid: b.child.id(),
            ours: Some("baseline"),
        });
    }
    // Which others to measure (`WARMPATH_BENCH_OTHERS`, default all): a profile of
    // warmpath alone runs with `none`.
    let others =
        std::env::var("WARMPATH_BENCH_OTHERS").unwrap_or_else(|_| "nginx,smg,sglang,vllm".into());
    let wanted = |name: &str| {
        others
            .split(',')
            .any(|o| name.to_lowercase().starts_with(o.trim()))
    };
    let mut children = Children(Vec::new());
    if let Some((child, url)) = wanted("nginx")
        .then(|| start_nginx(&engine.url, dir.path()))
        .flatten()
    {
        under.push(Under {
            name: "nginx proxy hop".into(),
            url,
            pid: child.id(),
            ours: None,
        });
        children.0.push(child);
    }
    let python = peer_python();
    let peers: [(&str, &str, &[&str]); 3] = [
        (
            "SMG cache_aware",
            "smg",
            &[
                "-m",
                "smg",
                "launch",
                "--policy",
                "cache_aware",
                "--disable-tokenizer-autoload",
            ],
        ),
        (
            "sglang-router cache_aware",
            "sglang_router",
            &[
                "-m",
                "sglang_router.launch_router",
                "--policy",
                "cache_aware",
            ],
        ),
        (
            "vllm-router round_robin",
            "vllm_router",
            &["-m", "vllm_router.launch_router"],
        ),
    ];
    for (name, module, args) in peers {
        if !wanted(name) {
            continue;
        }
        if let Some((child, url)) = start_peer(&python, module, args, &engine.url) {
            under.push(Under {
                name: name.into(),
                url,
                pid: child.id(),
                ours: None,
            });
            children.0.push(child);
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut table: Vec<Vec<Figures>> = Vec::new();
    runtime.block_on(async {
        let client: HttpClient =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(hyper_util::client::legacy::connect::HttpConnector::new());
        let prefix1 = warmpath_index::text::words(1, 150);
        let mut up = Vec::new();
        for u in std::mem::take(&mut under) {
            if wait_up(&client, &u, &body(&prefix1, 1024, 0)).await {
                println!("{} is up: {} (pid {})", u.name, u.url, u.pid);
                up.push(u);
            } else {
                assert!(u.ours.is_none(), "{} did not come up", u.name);
                println!("({} not measured: it did not serve within 90 s)", u.name);
            }
        }
        under = up;
        println!(
            "router overhead: one engine-sim (10^6x speed-up), non-streaming completions, 1 output token; \
             c=1: {pairs} interleaved rounds after {WARMUP} warm-up rounds, one connection each; \
             c={CLIENTS}: closed loop, {seconds} s per target; machine: {cores} cores shared by the client, the targets and the engine-sim"
        );
        for &size in &sizes {
            let prefix = warmpath_index::text::words(1, size / 8);
            let make = |i: usize| body(&prefix, size, i);
            for i in 0..WARMUP {
                send_completion(&client, &engine.url, &make(i)).await;
                for u in &under {
                    send_completion(&client, &u.url, &make(i)).await;
                }
            }
            let mut direct = Vec::new();
            let mut via: Vec<Vec<f64>> = vec![Vec::new(); under.len()];
            let mut diff: Vec<Vec<f64>> = vec![Vec::new(); under.len()];
            let n = under.len() + 1;
            let mut times = vec![Duration::ZERO; n];
            for i in 0..pairs {
                let body = make(WARMUP + i);
                // Rotate which goes first, so none always warms another's path.
                for k in 0..n {
                    let who = (i + k) % n;
                    let url = if who == 0 { &engine.url } else { &under[who - 1].url };
                    times[who] = send_completion(&client, url, &body).await;
                }
                let d = times[0].as_secs_f64() * 1e6;
                direct.push(d);
                for (j, t) in times[1..].iter().enumerate() {
                    via[j].push(t.as_secs_f64() * 1e6);
                    diff[j].push(t.as_secs_f64() * 1e6 - d);
                }
            }
            direct.sort_by(f64::total_cmp);
            println!("\n{size} B prompt, c=1 (µs):");
            println!(
                "  {:<28} p50 {:7.1}  p99 {:7.1}",
                "direct to engine-sim",
                percentile(&direct, 0.5),
                percentile(&direct, 0.99)
            );
            let mut row = vec![Figures::default(); under.len()];
            for (j, u) in under.iter().enumerate() {
                via[j].sort_by(f64::total_cmp);
                diff[j].sort_by(f64::total_cmp);
                row[j].added_p50 = percentile(&diff[j], 0.5);
                row[j].added_p99 = percentile(&diff[j], 0.99);
                println!(
                    "  {:<28} p50 {:7.1}  p99 {:7.1}   added p50 {:7.1}  added p99 {:7.1}",
                    u.name,
                    percentile(&via[j], 0.5),
                    percentile(&via[j], 0.99),
                    row[j].added_p50,
                    row[j].added_p99
                );
            }
            println!(
                "{size} B prompt, c={CLIENTS} saturated (median of {SATURATED_ROUNDS} rounds, the targets in rotation):"
            );
            let mut rates: Vec<Vec<f64>> = vec![Vec::new(); under.len()];
            let mut served = vec![0u64; under.len()];
            let mut cpu = vec![0f64; under.len()];
            for round in 0..SATURATED_ROUNDS {
                for k in 0..under.len() {
                    let j = (round + k) % under.len();
                    let u = &under[j];
                    let cpu0 = cpu_seconds(u.pid);
                    let t0 = Instant::now();
                    let deadline = t0 + Duration::from_secs_f64(seconds / SATURATED_ROUNDS as f64);
                    let mut tasks = Vec::new();
                    for w in 0..CLIENTS {
                        let client = client.clone();
                        let url = u.url.clone();
                        let bodies: Vec<Bytes> =
                            (0..64).map(|i| make(10_000 + w * 64 + i)).collect();
                        tasks.push(tokio::spawn(async move {
                            let mut n = 0u64;
                            while Instant::now() < deadline {
                                send_completion(&client, &url, &bodies[n as usize % bodies.len()])
                                    .await;
                                n += 1;
                            }
                            n
                        }));
                    }
                    let mut total = 0;
                    for t in tasks {
                        total += t.await.expect("worker");
                    }
                    rates[j].push(total as f64 / t0.elapsed().as_secs_f64());
                    served[j] += total;
                    cpu[j] += cpu_seconds(u.pid) - cpu0;
                }
            }
            for (j, u) in under.iter().enumerate() {
                rates[j].sort_by(f64::total_cmp);
                row[j].rate = percentile(&rates[j], 0.5);
                println!(
                    "  {:<28} {:>7.0} requests/s (rounds {:.0}..{:.0}); its CPU {:.2} s ({:.0} requests/s per core); RSS {:.0} MiB",
                    u.name,
                    row[j].rate,
                    rates[j][0],
                    rates[j][rates[j].len() - 1],
                    cpu[j],
                    served[j] as f64 / cpu[j].max(1e-9),
                    rss_mib(u.pid)
                );
            }
            table.push(row);
        }
    });
    // Issue 28's targets, per prompt size, for the built-in router.
    println!("\nissue 28 targets (warmpath prefix-aware, built-in tokenizer):");
    let find = |pred: &dyn Fn(&Under) -> bool| under.iter().position(pred);
    let ours = find(&|u| u.ours == Some("builtin")).expect("warmpath measured");
    let o200k_at = find(&|u| u.ours == Some("o200k"));
    let nginx_at = find(&|u| u.name.starts_with("nginx"));
    let peer_at: Vec<usize> = (0..under.len())
        .filter(|&j| under[j].ours.is_none() && Some(j) != nginx_at)
        .collect();
    let mark = |ok: bool| if ok { "met" } else { "NOT met" };
    for (s, row) in sizes.iter().zip(&table) {
        let w = row[ours];
        print!(
            "  {s} B: added p50 {:.0} µs, p99 {:.0} µs ({}: < 500 µs), {:.0} req/s",
            w.added_p50,
            w.added_p99,
            mark(w.added_p99 < 500.0),
            w.rate
        );
        if let Some(best) = peer_at.iter().map(|&j| row[j]).reduce(|a, b| Figures {
            added_p50: a.added_p50.min(b.added_p50),
            added_p99: a.added_p99.min(b.added_p99),
            rate: a.rate.max(b.rate),
        }) {
            let p = w.added_p50 / best.added_p50;
            let t = w.rate / best.rate;
            print!(
                "; vs best peer: p50 {p:.2}x ({}: <= 0.5x), throughput {t:.2}x ({}: >= 2x)",
                mark(p <= 0.5),
                mark(t >= 2.0)
            );
        }
        if let Some(n) = nginx_at {
            let p = w.added_p50 / row[n].added_p50;
            let t = w.rate / row[n].rate;
            print!(
                "; vs nginx: p50 {p:.2}x ({}: <= 2x), throughput {t:.2}x ({}: >= 0.7x)",
                mark(p <= 2.0),
                mark(t >= 0.7)
            );
        }
        if let Some(b) = find(&|u| u.ours == Some("baseline")) {
            print!(
                "; vs the baseline binary: p50 {:.2}x, p99 {:.2}x, throughput {:.2}x",
                w.added_p50 / row[b].added_p50,
                w.added_p99 / row[b].added_p99,
                w.rate / row[b].rate
            );
        }
        if let Some(o) = o200k_at {
            let r = row[o].added_p50 / w.added_p50;
            print!(
                "; o200k added p50 {r:.2}x the built-in's{}",
                if *s == 4096 {
                    format!(" ({}: <= 1.5x)", mark(r <= 1.5))
                } else {
                    String::new()
                }
            );
        }
        println!();
    }
    drop(children);
}
