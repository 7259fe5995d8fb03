//! `simulate --report DIR` and `demo --report DIR` end to end: the page is written, and
//! the distribution's Chromium, headless, renders its plots: its screenshot holds the
//! bars' and the curves' colours.

use crate::{scratch_dir, warmpath};
use std::path::Path;
use std::process::Command;

/// The GPU tier's bar colour (`report::TIER_COLOURS[0]`) and the first two series'
/// line colours (plotters' Palette99: 0 and 1).
const GPU_GREEN: [u8; 3] = [46, 125, 50];
const SERIES: [[u8; 3]; 2] = [[230, 25, 75], [60, 180, 75]];

/// Chromium, headless and shut off from the network, screenshots `page` at 900 px wide
/// into `png`; the browser's flags are those this machine's notes give for Debian's
/// package as root.
pub fn screenshot(page: &Path, png: &Path, height: u32) {
    // A profile of its own: two browsers on one profile would meet.
    let profile = png.with_extension("profile");
    let out = Command::new(warmpath_testkit::system_tool("chromium"))
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--window-size=900,{height}"))
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium runs (the distribution's package; tests/run installs it)");
    assert!(
        out.status.success() && png.exists(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How many pixels of the screenshot `png` have each colour of `colours`.
fn pixels_of(png: &Path, colours: &[[u8; 3]]) -> Vec<usize> {
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(png).expect("the screenshot"),
    ));
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("a size")];
    let info = reader.next_frame(&mut buf).expect("a frame");
    let channels = info.color_type.samples();
    assert!(channels >= 3, "{:?}", info.color_type);
    let mut counts = vec![0; colours.len()];
    for px in buf[..info.buffer_size()].chunks_exact(channels) {
        for (i, c) in colours.iter().enumerate() {
            if px[..3] == c[..] {
                counts[i] += 1;
            }
        }
    }
    counts
}

/// Runs `warmpath args…` with `--report DIR` (a scratch `name`) for two policies,
/// round-robin and prefix-aware, and checks the page it wrote: a plot each for hit rates
/// and TTFT CDFs and one of load per policy, holding `says`; and Chromium renders them:
/// the GPU bars (two, 60+ px wide and up to 300 px tall) and the two policies' curves (a
/// few hundred px long each) are in its screenshot.
fn assert_report_renders(name: &str, args: &[&str], says: &str) {
    let dir = scratch_dir(name);
    let mut all = args.to_vec();
    all.extend(["--policy", "round-robin", "prefix-aware"]);
    all.extend(["--report", dir.to_str().unwrap()]);
    let out = warmpath(&all);
    assert!(
        out.status.success(),
        "{all:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = dir.join("report.html");
    let html = std::fs::read_to_string(&page).expect("the report");
    assert_eq!(html.matches("<svg").count(), 4, "{html}");
    assert!(html.contains("Load per instance: prefix-aware"), "{html}");
    assert!(html.contains(says), "{html}");
    let png = dir.join("shot.png");
    screenshot(&page, &png, 2200);
    let [green, first, second] = pixels_of(&png, &[GPU_GREEN, SERIES[0], SERIES[1]])[..] else {
        unreachable!()
    };
    assert!(green > 5_000, "GPU bars: {green} px");
    assert!(
        first > 300 && second > 300,
        "curves: {first} and {second} px"
    );
}

#[test]
fn the_simulate_report_renders_its_plots_in_chromium() {
    let args = [
        "simulate",
        "--workload",
        "bots",
        "--requests",
        "400",
        "--instances",
        "4",
    ];
    assert_report_renders("report-simulate", &args, "a discrete-event simulation");
}

#[test]
fn the_demo_report_renders_its_plots_in_chromium() {
    let args = ["demo", "--requests", "60", "--instances", "2"];
    assert_report_renders("report-demo", &args, "real processes on loopback");
}

/// A report directory that cannot be written is refused before the run, with the path.
#[test]
fn an_unwritable_report_directory_fails_at_once() {
    let blocker = scratch_dir("report-blocked").join("a-file");
    std::fs::write(&blocker, b"").unwrap();
    let dir = blocker.join("report");
    for command in [
        &["simulate", "--workload", "bots", "--requests", "50"][..],
        &["demo", "--requests", "10"],
    ] {
        let mut args = command.to_vec();
        args.extend(["--report", dir.to_str().unwrap()]);
        let out = warmpath(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            stderr.contains("--report") && stderr.contains("cannot make the directory"),
            "{stderr}"
        );
        // Nothing ran: no engine started, no simulation printed.
        assert!(String::from_utf8_lossy(&out.stdout).is_empty(), "{args:?}");
    }
}
