//! `warmpath-jepsen`: runs warmpath under faults and checks what its clients saw.
//!
//!   warmpath-jepsen run --scenario NAME --time-limit S --seed N
//!   warmpath-jepsen suite short|long
//!   warmpath-jepsen list
//!   warmpath-jepsen check --history DIR/history.jsonl --scenario NAME
//!
//! Each run writes `OUT/NAME/history.jsonl`, `report.txt`, `report.html` and the
//! processes' logs, and exits non-zero when a check fails.

mod client;
mod cluster;
mod net;
mod report;
mod scenario;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;
use warmpath_jepsen::{check, history};

#[derive(Parser, Debug)]
#[command(
    name = "warmpath-jepsen",
    about = "Runs warmpath under faults and checks the histories."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Debug)]
struct Common {
    /// Seconds of faults and client load per scenario.
    #[arg(long, default_value_t = 30)]
    time_limit: u64,
    /// Seeds the clients' operation mix and the nemesis's choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The warmpath binary under test (default: the one built beside this harness).
    #[arg(long)]
    bin: Option<PathBuf>,
    /// Where histories, reports and logs go.
    #[arg(long, default_value = "target/jepsen")]
    out: PathBuf,
    /// Where the processes run.
    #[arg(long, value_enum, default_value = "auto")]
    net: net::Mode,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs one scenario.
    Run {
        #[arg(long)]
        scenario: String,
        #[command(flatten)]
        common: Common,
    },
    /// Runs a suite: `short` (CI) or `long` (every scenario).
    Suite {
        #[arg(value_parser = ["short", "long"])]
        which: String,
        #[command(flatten)]
        common: Common,
    },
    /// Lists the scenarios.
    List,
    /// Checks a recorded history again (for a scenario's promises).
    Check {
        #[arg(long)]
        history: PathBuf,
        #[arg(long)]
        scenario: String,
    },
}

fn find(name: &str) -> Result<scenario::Scenario> {
    match scenario::all().into_iter().find(|s| s.name == name) {
        Some(s) => Ok(s),
        None => bail!(
            "no scenario {name:?}; `warmpath-jepsen list` names them: {}",
            scenario::all()
                .iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn options(c: &Common) -> Result<scenario::Options> {
    let bin = c.bin.clone().unwrap_or_else(warmpath_testkit::warmpath_bin);
    if !bin.is_file() {
        bail!(
            "no warmpath binary at {} (build it: `cargo build --release --bins`, or give --bin)",
            bin.display()
        );
    }
    Ok(scenario::Options {
        time_limit: Duration::from_secs(c.time_limit),
        seed: c.seed,
        bin: std::fs::canonicalize(bin)?,
        out: c.out.clone(),
        net: c.net,
    })
}

/// Runs `scenarios`, prints and writes each report; true if all passed (or were skipped).
fn run_all(scenarios: &[scenario::Scenario], c: &Common) -> Result<bool> {
    let o = options(c)?;
    let mut summary = Vec::new();
    let mut all_pass = true;
    for s in scenarios {
        let secs = c.time_limit.max(s.min_time_limit.as_secs());
        println!("-- {}: {} ({secs} s of faults)", s.name, s.about);
        let r = scenario::run(s, &o)?;
        let text = report::text(&r, c.seed, c.time_limit);
        print!("{text}");
        let dir = o.out.join(s.name);
        std::fs::write(dir.join("report.txt"), &text)?;
        std::fs::write(dir.join("report.html"), report::html(&r, &text))?;
        all_pass &= r.pass() || r.skipped.is_some();
        summary.push(format!(
            "{:<22} {:<8} {}",
            s.name,
            match (&r.skipped, r.pass()) {
                (Some(_), _) => "skipped",
                (None, true) => "PASS",
                (None, false) => "FAIL",
            },
            s.defect.map_or(String::new(), |d| format!("defect {d}"))
        ));
    }
    if scenarios.len() > 1 {
        println!(
            "\n== suite: {} scenarios, seed {}, {} s each",
            scenarios.len(),
            c.seed,
            c.time_limit
        );
        for l in &summary {
            println!("   {l}");
        }
    }
    Ok(all_pass)
}

/// On SIGINT or SIGTERM (a `timeout`, a Ctrl-C), kill what the run started and remove its
/// namespaces before exiting: `Drop` does not run then.
fn clean_up_on_signal() {
    std::thread::spawn(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let Ok(rt) = rt else { return };
        rt.block_on(async {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) else {
                return;
            };
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            eprintln!(
                "warmpath-jepsen: stopped by a signal; removing the run's processes and namespaces"
            );
            net::cleanup_after_signal();
            std::process::exit(130);
        });
    });
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    clean_up_on_signal();
    let pass = match cli.command {
        Command::List => {
            for s in scenario::all() {
                println!(
                    "{:<22} {}{}{}",
                    s.name,
                    s.about,
                    s.defect.map_or(String::new(), |d| format!(" [defect {d}]")),
                    if s.short { " [short suite]" } else { "" }
                );
            }
            true
        }
        Command::Run { scenario, common } => run_all(&[find(&scenario)?], &common)?,
        Command::Suite { which, common } => {
            let all = scenario::all();
            let chosen: Vec<_> = all
                .into_iter()
                .filter(|s| which == "long" || s.short)
                .collect();
            run_all(&chosen, &common)?
        }
        Command::Check { history, scenario } => {
            let s = find(&scenario)?;
            let h = history::History::from_jsonl(&std::fs::read_to_string(&history)?)?;
            let checks = check::all(&h, &s.expect);
            let mut pass = true;
            for c in &checks {
                println!("{:?} {}: {}", c.pass, c.name, c.summary);
                for d in &c.details {
                    println!("    {d}");
                }
                pass &= c.pass != Some(false);
            }
            pass
        }
    };
    if !pass {
        std::process::exit(1);
    }
    Ok(())
}
