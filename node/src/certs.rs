//! `warmpath certs`: a development CA and certificates for the residency links (and any
//! other mutual-TLS link): `ca.pem` and `ca.key`, then `NAME.pem` and `NAME.key` per
//! `--name`, valid for the name, localhost, 127.0.0.1, ::1 and each `--san`. For production,
//! issue the same files from your own CA.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct CertsArgs {
    /// Directory to write into (created; existing files of the same names are replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// A process to issue a certificate for (repeat: agent-1, router-1, …).
    #[arg(long = "name", required = true)]
    pub names: Vec<String>,
    /// Another DNS name or IP address every certificate is valid for (repeatable).
    #[arg(long = "san")]
    pub sans: Vec<String>,
}

pub fn run(args: CertsArgs) -> Result<()> {
    for n in &args.names {
        if n.is_empty()
            || !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            || n == "ca"
        {
            bail!("--name {n:?}: letters, digits, '-', '_' and '.' only, and not ca");
        }
    }
    warmpath_residency::tls::generate(&args.out, &args.names, &args.sans)
        .map_err(anyhow::Error::msg)?;
    println!(
        "wrote {}/ca.pem, ca.key and a certificate and key for {} (keys are mode 0600; keep ca.key offline)",
        args.out.display(),
        args.names.join(", ")
    );
    Ok(())
}
