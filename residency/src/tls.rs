//! Mutual TLS for the residency links: every agent and router holds a certificate signed by
//! the cluster's CA and trusts only that CA, in both directions (a QUIC client without such
//! a certificate is refused in the handshake). Certificates come from PEM files;
//! [`generate`] makes a development CA and certificates (`warmpath certs`).
//!
//! TLS 1.3 only (QUIC requires it), the `ring` provider, ALPN `warmpath-residency/1`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The ALPN protocol of the residency session, version 1.
pub const ALPN: &[u8] = b"warmpath-residency/1";

/// Where one process's TLS material lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The cluster CA's certificate: the only issuer trusted.
    pub ca: PathBuf,
    /// This process's certificate chain and key.
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// The files `warmpath certs` writes for `name` in `dir`.
    pub fn in_dir(dir: &Path, name: &str) -> Self {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        }
    }

    fn load(
        &self,
    ) -> Result<
        (
            rustls::RootCertStore,
            Vec<CertificateDer<'static>>,
            PrivateKeyDer<'static>,
        ),
        String,
    > {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&read(&self.ca)?) {
            let c = c.map_err(|e| format!("{}: {e}", self.ca.display()))?;
            roots
                .add(c)
                .map_err(|e| format!("{}: {e}", self.ca.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("{}: no CA certificate", self.ca.display()));
        }
        let chain = CertificateDer::pem_slice_iter(&read(&self.cert)?)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{}: {e}", self.cert.display()))?;
        if chain.is_empty() {
            return Err(format!("{}: no certificate", self.cert.display()));
        }
        let key = PrivateKeyDer::from_pem_slice(&read(&self.key)?)
            .map_err(|e| format!("{}: {e}", self.key.display()))?;
        Ok((roots, chain, key))
    }

    /// The agent's side: requires a client certificate from the cluster CA.
    pub fn server_config(&self) -> Result<quinn::ServerConfig, String> {
        let (roots, chain, key) = self.load()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .map_err(|e| e.to_string())?;
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| format!("{}: {e}", self.cert.display()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let quic =
            quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
        Ok(quinn::ServerConfig::with_crypto(Arc::new(quic)))
    }

    /// The router's side: trusts the cluster CA only and presents its own certificate.
    pub fn client_config(&self) -> Result<quinn::ClientConfig, String> {
        let (roots, chain, key) = self.load()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("{}: {e}", self.cert.display()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let quic =
            quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
        Ok(quinn::ClientConfig::new(Arc::new(quic)))
    }
}

/// Writes a development CA (`ca.pem`, `ca.key`) and, for each name, a certificate signed
/// by it (`NAME.pem`, `NAME.key`, keys mode 0600) valid for the name, `localhost`,
/// 127.0.0.1 and ::1 plus `extra_sans` (DNS names or IP addresses).
pub fn generate(dir: &Path, names: &[String], extra_sans: &[String]) -> Result<(), String> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let err = |e: rcgen::Error| e.to_string();
    let ca_key = KeyPair::generate().map_err(err)?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "warmpath development CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(err)?;
    write(&dir.join("ca.pem"), ca_cert.pem().as_bytes(), false)?;
    write(&dir.join("ca.key"), ca_key.serialize_pem().as_bytes(), true)?;
    let issuer = Issuer::new(ca_params, ca_key);
    for name in names {
        let mut sans = vec![
            name.clone(),
            "localhost".into(),
            "127.0.0.1".into(),
            "::1".into(),
        ];
        sans.extend(extra_sans.iter().cloned());
        let key = KeyPair::generate().map_err(err)?;
        let mut params = CertificateParams::new(sans).map_err(err)?;
        params
            .distinguished_name
            .push(DnType::CommonName, name.as_str());
        let cert = params.signed_by(&key, &issuer).map_err(err)?;
        write(
            &dir.join(format!("{name}.pem")),
            cert.pem().as_bytes(),
            false,
        )?;
        write(
            &dir.join(format!("{name}.key")),
            key.serialize_pem().as_bytes(),
            true,
        )?;
    }
    Ok(())
}

fn write(path: &Path, bytes: &[u8], secret: bool) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(bytes)
        .map_err(|e| format!("{}: {e}", path.display()))
}
