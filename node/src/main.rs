//! `warmpath`: one binary, a subcommand per role.
//!
//! - `simulate`: discrete-event simulation of a cluster on a trace or a synthetic
//!   workload, with the router's own policy code.
//! - `demo`: the main job on an embedded default (see `demo.rs`).

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod demo;
mod simulate;

#[derive(Parser, Debug)]
#[command(
    name = "warmpath",
    version,
    about = "KV-cache-aware gateway for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Simulate a cluster on a trace or a synthetic workload and compare policies.
    Simulate(simulate::SimulateArgs),
    /// Run the demo: a prefix-heavy workload through every policy, with a comparison table.
    Demo(demo::DemoArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => simulate::run(args),
        Command::Demo(args) => demo::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
