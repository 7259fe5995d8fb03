//! The verdict of a run, as text (printed and written to `report.txt`) and as one HTML
//! page (`report.html`): the checks, the faults, and a timeline of every operation by
//! client, coloured by outcome, with the fault windows shaded.

use crate::check::Check;
use crate::history::{Outcome, F};
use crate::scenario::Outcome as Run;
use std::fmt::Write;

fn verdict(c: &Check) -> &'static str {
    match c.pass {
        Some(true) => "pass",
        Some(false) => "FAIL",
        None => "skipped",
    }
}

/// The text report of one run.
pub fn text(r: &Run, seed: u64, time_limit_s: u64) -> String {
    let mut s = String::new();
    let s_ = &r.scenario;
    let _ = writeln!(
        s,
        "== {} ({}){}: {}",
        s_.name,
        s_.about,
        s_.defect
            .map_or(String::new(), |d| format!(", issue 12 defect {d}")),
        if let Some(why) = &r.skipped {
            format!("SKIPPED: {why}")
        } else if r.pass() {
            "PASS".into()
        } else {
            "FAIL".into()
        }
    );
    if r.skipped.is_some() {
        return s;
    }
    let h = &r.history;
    let count = |f: F, o: Outcome| h.ops.iter().filter(|x| x.f == f && x.outcome == o).count();
    let _ = writeln!(
        s,
        "   seed {seed}, time limit {time_limit_s} s, {} network, took {:.0} s; {} operations: reads {}/{} ok, writes {} ok {} refused {} unknown, creates {} ok {} refused {} unknown, routed {} ok {} errors {} unknown",
        r.network,
        r.took.as_secs_f64(),
        h.ops.len(),
        count(F::Read, Outcome::Ok),
        h.ops.iter().filter(|x| x.f == F::Read).count(),
        count(F::Write, Outcome::Ok),
        count(F::Write, Outcome::Fail),
        count(F::Write, Outcome::Info),
        count(F::Create, Outcome::Ok),
        count(F::Create, Outcome::Fail),
        count(F::Create, Outcome::Info),
        count(F::Route, Outcome::Ok) + count(F::Limited, Outcome::Ok),
        count(F::Route, Outcome::Fail) + count(F::Limited, Outcome::Fail),
        count(F::Route, Outcome::Info) + count(F::Limited, Outcome::Info),
    );
    for c in &r.checks {
        let _ = writeln!(s, "   {:<7} {}: {}", verdict(c), c.name, c.summary);
        for d in c.details.iter().take(8) {
            let _ = writeln!(s, "           {d}");
        }
        if c.details.len() > 8 {
            let _ = writeln!(
                s,
                "           … {} more in report.html",
                c.details.len() - 8
            );
        }
    }
    s
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The HTML report of one run: self-contained, no scripts.
pub fn html(r: &Run, text: &str) -> String {
    let h = &r.history;
    let end = h
        .ops
        .iter()
        .map(|o| o.complete_ms)
        .chain(h.faults.iter().map(|f| f.at_ms))
        .fold(1.0, f64::max);
    let mut procs: Vec<usize> = h
        .ops
        .iter()
        .filter(|o| o.f != F::FinalRead)
        .map(|o| o.process)
        .collect();
    procs.sort_unstable();
    procs.dedup();
    let (w, row) = (1200.0, 18.0);
    let height = row * procs.len() as f64 + 30.0;
    let x = |ms: f64| 120.0 + ms / end * (w - 130.0);
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="monospace" font-size="11">"#
    );
    // Fault windows.
    let mut open: Vec<(String, f64)> = Vec::new();
    for f in &h.faults {
        let key = f.what.split_whitespace().nth(1).unwrap_or("").to_string();
        if f.what.starts_with("start") {
            open.push((key, f.at_ms));
        } else if f.what.starts_with("stop") {
            if let Some(i) = open.iter().position(|(k, _)| *k == key) {
                let (_, from) = open.remove(i);
                let _ = write!(
                    svg,
                    r##"<rect x="{:.1}" y="0" width="{:.1}" height="{height}" fill="#f4d9a6"><title>{}</title></rect>"##,
                    x(from),
                    (x(f.at_ms) - x(from)).max(1.0),
                    esc(&f.what)
                );
            }
        }
    }
    for (i, p) in procs.iter().enumerate() {
        let y = row * i as f64 + 4.0;
        let label = if *p < 10 {
            format!("admin {p}")
        } else if *p < 20 {
            format!("route {p}")
        } else {
            format!("flood {p}")
        };
        let _ = write!(svg, r#"<text x="4" y="{:.1}">{label}</text>"#, y + 11.0);
        for o in h.ops.iter().filter(|o| o.process == *p) {
            let color = match o.outcome {
                Outcome::Ok => "#4a9a4a",
                Outcome::Fail => "#c04040",
                Outcome::Info => "#d0a000",
            };
            let _ = write!(
                svg,
                r#"<rect x="{:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{}</title></rect>"#,
                x(o.invoke_ms),
                (x(o.complete_ms) - x(o.invoke_ms)).max(1.0),
                row - 4.0,
                esc(&format!(
                    "{:?} {:?} {:?} [{:.0}-{:.0} ms] {}",
                    o.f, o.value, o.outcome, o.invoke_ms, o.complete_ms, o.detail
                ))
            );
        }
    }
    let _ = write!(
        svg,
        r#"<text x="120" y="{:.1}">0 s</text><text x="{:.1}" y="{:.1}" text-anchor="end">{:.1} s</text></svg>"#,
        height - 4.0,
        w - 10.0,
        height - 4.0,
        end / 1e3
    );
    let mut faults = String::new();
    for f in &h.faults {
        let _ = writeln!(faults, "{:>8.1} s  {}", f.at_ms / 1e3, esc(&f.what));
    }
    let mut details = String::new();
    for c in r.checks.iter().filter(|c| !c.details.is_empty()) {
        let _ = writeln!(
            details,
            "<h3>{}</h3><pre>{}</pre>",
            esc(c.name),
            esc(&c.details.join("\n"))
        );
    }
    format!(
        "<!doctype html><meta charset=utf-8><title>warmpath-jepsen {name}</title>\
<style>body{{font-family:sans-serif;margin:1em}}pre{{background:#f6f6f6;padding:.5em}}</style>\
<h1>{name}: {verdict}</h1><pre>{text}</pre>\
<h2>Timeline</h2><p>One row per client; green ok, red refused or failed clearly, amber unknown; shaded: faults.</p>{svg}\
<h2>Faults</h2><pre>{faults}</pre>{details}",
        name = esc(r.scenario.name),
        verdict = if r.pass() { "PASS" } else { "FAIL" },
        text = esc(text),
    )
}
