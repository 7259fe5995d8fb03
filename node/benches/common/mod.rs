//! What the process-level benchmarks share: starting `warmpath` processes on loopback and
//! reading percentiles.

#![allow(dead_code)] // each benchmark uses its own subset

#[allow(unused_imports)] // each benchmark uses its own subset
pub use warmpath_testkit::{free_addr, Proc};

/// Starts `warmpath args…` with quiet logs and waits for its first `lines` stdout lines.
pub fn start<S: AsRef<str>>(args: &[S], lines: usize) -> Proc {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    Proc::start_lines(&args, lines, "error")
}

/// The `q` quantile of sorted samples, by nearest rank.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// CPU seconds (user + system) process `pid` has used, from `/proc` (Linux).
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name: utime and stime are the 12th and 13th, in clock ticks.
    let rest = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The HTTP client the request-path benchmarks use.
pub type HttpClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

/// POSTs `body` to `url`'s `/v1/completions`, reads the whole answer (which must be a
/// success) and returns how long that took.
pub async fn send_completion(
    client: &HttpClient,
    url: &str,
    body: &bytes::Bytes,
) -> std::time::Duration {
    use http_body_util::BodyExt;
    let req = hyper::Request::post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(body.clone()))
        .expect("valid request");
    let t = std::time::Instant::now();
    let resp = client.request(req).await.expect("request succeeds");
    assert!(resp.status().is_success(), "status {}", resp.status());
    resp.into_body().collect().await.expect("body");
    t.elapsed()
}

/// The text of `url`'s `/metrics`.
pub fn scrape(url: &str) -> String {
    let out = std::process::Command::new("curl")
        .args(["-s", &format!("{url}/metrics")])
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The value of the first sample in `text` whose line starts with `prefix` (NaN: none).
pub fn value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(f64::NAN)
}
