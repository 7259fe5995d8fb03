//! `warmpath demo`: the main job on an embedded default.
//!
//! Today it simulates a cluster of 8 instances (120k-token GPU KV caches) and 2 router
//! replicas on the embedded `bots` workload (templated bots sharing long system prompts,
//! 3,000 requests at 30/s) with every policy and prints the comparison table. The live version, with real routers and
//! engine simulators on loopback, replaces it with the gateway.

use crate::simulate::{self, SimulateArgs};
use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Seed of the workload and of every random choice.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

pub fn run(args: DemoArgs) -> Result<()> {
    use clap::Parser;
    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        sim: SimulateArgs,
    }
    let seed = args.seed.to_string();
    let wrapper = Wrapper::try_parse_from([
        "demo",
        "--workload",
        "bots",
        "--routers",
        "2",
        "--seed",
        &seed,
    ])?;
    println!("warmpath demo: simulated cluster, same routing code as the router\n");
    simulate::run(wrapper.sim)
}
