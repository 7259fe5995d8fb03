//! `warmpath`: one binary, a subcommand per role.
//!
//! - `simulate`: discrete-event simulation of a cluster on a trace or a synthetic
//!   workload, with the router's own policy code.
//! - `demo`: the main job on an embedded default (see `demo.rs`).

use clap::{Parser, Subcommand};
use std::process::ExitCode;

use warmpath::{admin, agent, certs, demo, engine_sim, loadgen, router, simulate};

/// mimalloc rather than glibc's malloc: the request path allocates and frees hyper's
/// per-request buffers on every request, across threads (record 0116).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Run the OpenAI-compatible gateway.
    Router(router::RouterArgs),
    /// Run the cache-agent of one GPU host: its L1 and L2 KV tiers and the engines' block API.
    Agent(agent::AgentArgs),
    /// Write a development CA and certificates for the mutual-TLS links.
    Certs(certs::CertsArgs),
    /// Serve the engine model over HTTP, like a vLLM server.
    EngineSim(engine_sim::EngineSimArgs),
    /// Send load to an OpenAI-compatible endpoint and measure it.
    Loadgen(loadgen::LoadgenArgs),
    /// Manage tenants, pools and API keys through a router's admin API.
    Admin(admin::AdminArgs),
}

/// Logs to stderr; `WARMPATH_LOG` sets the filter (default `info,openraft=warn`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WARMPATH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let result = match cli.command {
        Command::Simulate(args) => simulate::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Router(args) => router::run(args),
        Command::Agent(args) => agent::run(args),
        Command::Certs(args) => certs::run(args),
        Command::EngineSim(args) => engine_sim::run(args),
        Command::Loadgen(args) => loadgen::run(args),
        Command::Admin(args) => admin::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
