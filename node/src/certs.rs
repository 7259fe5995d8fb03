//! `warmpath certs`: a development CA and certificates for the residency links: `ca.pem`
//! and `ca.key`, then `NAME.pem` and `NAME.key` per `--router NAME` or `--agent NAME`,
//! each valid for its name and each `--san`, and for localhost, 127.0.0.1 and ::1 only with
//! `--loopback`, and carrying its role (the URI name `warmpath:role:router` or
//! `warmpath:role:agent`: an agent serves residency to routers only, a router follows
//! agents only; decision 0102). For production, issue the same files from your own CA,
//! with the same URI names.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use warmpath_residency::tls::Role;

#[derive(Args, Debug, Clone)]
pub struct CertsArgs {
    /// Directory to write into (created mode 0700; existing files of the same names are
    /// replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// A router to issue a certificate for (repeatable): it may follow agents.
    #[arg(long = "router")]
    pub routers: Vec<String>,
    /// An agent to issue a certificate for (repeatable): it may serve residency. A router
    /// that follows `NAME@HOST:PORT` (or `HOST:PORT`, by its host) checks this name.
    #[arg(long = "agent")]
    pub agents: Vec<String>,
    /// Refused: say which role each certificate has, with --router or --agent.
    #[arg(long = "name", hide = true)]
    pub names: Vec<String>,
    /// Another DNS name or IP address every certificate is valid for (repeatable).
    #[arg(long = "san")]
    pub sans: Vec<String>,
    /// Make every certificate valid for localhost, 127.0.0.1 and ::1 too (one machine,
    /// development only: any holder of such an agent certificate can then stand in for
    /// an agent followed on loopback).
    #[arg(long)]
    pub loopback: bool,
}

pub fn run(args: CertsArgs) -> Result<()> {
    if let Some(n) = args.names.first() {
        bail!("--name {n:?}: certificates carry their role now; give --router {n} or --agent {n}");
    }
    let certs: Vec<(String, Role)> = args
        .routers
        .iter()
        .map(|n| (n.clone(), Role::Router))
        .chain(args.agents.iter().map(|n| (n.clone(), Role::Agent)))
        .collect();
    if certs.is_empty() {
        bail!("name at least one certificate: --router NAME or --agent NAME");
    }
    let mut seen = std::collections::HashSet::new();
    for (n, _) in &certs {
        if n.is_empty()
            || !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            || n == "ca"
        {
            bail!("{n:?}: letters, digits, '-', '_' and '.' only, and not ca");
        }
        if !seen.insert(n.as_str()) {
            bail!("{n:?} is named twice: one certificate, one role");
        }
    }
    warmpath_residency::tls::generate(&args.out, &certs, &args.sans, args.loopback)
        .map_err(anyhow::Error::msg)?;
    let list: Vec<String> = certs
        .iter()
        .map(|(n, r)| format!("{n} ({})", r.name()))
        .collect();
    println!(
        "wrote {}/ca.pem, ca.key and a certificate and key for {} (keys are mode 0600; keep ca.key offline)",
        args.out.display(),
        list.join(", ")
    );
    Ok(())
}
