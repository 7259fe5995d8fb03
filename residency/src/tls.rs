//! Mutual TLS for the residency links: every agent and router holds a certificate signed by
//! the cluster's CA and trusts only that CA, in both directions (a QUIC client without such
//! a certificate is refused in the handshake). Certificates come from PEM files;
//! [`generate`] makes a development CA and certificates (`warmpath certs`).
//!
//! Each certificate carries its [`Role`] as a URI name (`warmpath:role:router`,
//! `warmpath:role:agent`), or, from an issuer that writes DNS names only, as the DNS name
//! `router.role.warmpath.invalid` or `agent.role.warmpath.invalid`: an agent completes the handshake only with a router's
//! certificate, and a router only with an agent's whose names include the one it follows
//! ([0102](../../docs/decisions/0102-certificate-roles.md)). A certificate of the cluster
//! CA without a role, or with both, is refused on both sides.
//!
//! TLS 1.3 only (QUIC requires it), the `ring` provider, ALPN `warmpath-residency/2` or `/1`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

/// The ALPN protocol of the residency session, version 1.
pub const ALPN: &[u8] = b"warmpath-residency/1";

/// Version 2 ([`crate::Wire::V2Delta`], record 0123). Agents and routers offer both, version 2
/// first; an agent picks the first of its own list the router offered, so two ends of this
/// build speak version 2 and either end of an older one speaks version 1.
pub const ALPN_V2: &[u8] = b"warmpath-residency/2";

/// The protocols both ends offer, preferred first.
fn alpn_protocols() -> Vec<Vec<u8>> {
    vec![ALPN_V2.to_vec(), ALPN.to_vec()]
}

/// What a certificate allows its holder to be on a residency link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Follows agents: is served residency and sends tenant tables and prefetch hints.
    Router,
    /// Serves residency to routers.
    Agent,
}

impl Role {
    /// The URI name that carries the role in a certificate's subject alternative names.
    pub fn uri(self) -> &'static str {
        match self {
            Role::Router => "warmpath:role:router",
            Role::Agent => "warmpath:role:agent",
        }
    }

    /// The DNS name that carries the role for issuers that write DNS names only (Helm's
    /// `genSignedCert`): under `.invalid`, which never resolves (RFC 2606), so no host
    /// has it.
    pub fn dns(self) -> &'static str {
        match self {
            Role::Router => "router.role.warmpath.invalid",
            Role::Agent => "agent.role.warmpath.invalid",
        }
    }

    /// `router` or `agent`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Agent => "agent",
        }
    }
}

/// The role a certificate (DER) carries, as its [`Role::uri`] or [`Role::dns`] name:
/// `None` for none, for both, or for a certificate that does not parse.
pub fn role_of(der: &[u8]) -> Option<Role> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    let mut roles = san.value.general_names.iter().filter_map(|n| {
        let (name, of): (&str, fn(Role) -> &'static str) = match n {
            GeneralName::URI(u) => (u, Role::uri),
            GeneralName::DNSName(d) => (d, Role::dns),
            _ => return None,
        };
        [Role::Router, Role::Agent]
            .into_iter()
            .find(|r| name.eq_ignore_ascii_case(of(*r)))
    });
    let first = roles.next()?;
    roles.all(|r| r == first).then_some(first)
}

fn require_role(der: &[u8], want: Role) -> Result<(), rustls::Error> {
    match role_of(der) {
        Some(r) if r == want => Ok(()),
        other => {
            tracing::debug!(want = want.name(), got = ?other, "residency peer of the wrong role");
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }
}

/// The agent's check of a client: the cluster CA's (webpki), then the router role.
#[derive(Debug)]
struct RoleClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    role: Role,
}

impl ClientCertVerifier for RoleClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        require_role(end_entity, self.role)?;
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The router's check of an agent: the cluster CA's and the name followed (webpki), then
/// the agent role.
#[derive(Debug)]
struct RoleServerVerifier {
    inner: Arc<dyn ServerCertVerifier>,
    role: Role,
}

impl ServerCertVerifier for RoleServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ok = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        require_role(end_entity, self.role)?;
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

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

    /// The agent's side: requires a router's certificate from the cluster CA.
    pub fn server_config(&self) -> Result<quinn::ServerConfig, String> {
        let (roots, chain, key) = self.load()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let inner = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .map_err(|e| e.to_string())?;
        let verifier = Arc::new(RoleClientVerifier {
            inner,
            role: Role::Router,
        });
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| format!("{}: {e}", self.cert.display()))?;
        tls.alpn_protocols = alpn_protocols();
        let quic =
            quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
        Ok(quinn::ServerConfig::with_crypto(Arc::new(quic)))
    }

    /// The router's side: trusts agents' certificates of the cluster CA only and presents
    /// its own certificate.
    pub fn client_config(&self) -> Result<quinn::ClientConfig, String> {
        let (roots, chain, key) = self.load()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .map_err(|e| e.to_string())?;
        let verifier = Arc::new(RoleServerVerifier {
            inner,
            role: Role::Agent,
        });
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("{}: {e}", self.cert.display()))?;
        tls.alpn_protocols = alpn_protocols();
        let quic =
            quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
        Ok(quinn::ClientConfig::new(Arc::new(quic)))
    }
}

/// The loopback names `generate` adds to every certificate when asked (`--loopback`).
pub const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// Writes a development CA (`ca.pem`, `ca.key`) and, for each (name, role), a certificate
/// signed by it (`NAME.pem`, `NAME.key`) valid for the name plus `extra_sans` (DNS names or
/// IP addresses), and for [`LOOPBACK_NAMES`] when `loopback`, carrying the role. A new
/// directory is made mode 0700; keys are written mode 0600, whatever the file was before.
pub fn generate(
    dir: &Path,
    certs: &[(String, Role)],
    extra_sans: &[String],
    loopback: bool,
) -> Result<(), String> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
        SanType,
    };
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
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
    for (name, role) in certs {
        let mut sans = vec![name.clone()];
        if loopback {
            sans.extend(LOOPBACK_NAMES.iter().map(|n| n.to_string()));
        }
        sans.extend(extra_sans.iter().cloned());
        let key = KeyPair::generate().map_err(err)?;
        let mut params = CertificateParams::new(sans).map_err(err)?;
        params.subject_alt_names.push(SanType::URI(
            rcgen::string::Ia5String::try_from(role.uri()).map_err(err)?,
        ));
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
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mode = if secret { 0o600 } else { 0o644 };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // `mode` applies only to a file created here: one that existed keeps its mode unless
    // set again, before the key is written into it.
    f.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(bytes)
        .map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_carry_their_role_and_no_loopback_name_unless_asked() {
        let dir = std::env::temp_dir().join(format!("wp-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        generate(
            &dir,
            &[("r1".into(), Role::Router), ("a1".into(), Role::Agent)],
            &[],
            false,
        )
        .unwrap();
        let der = |n: &str| {
            CertificateDer::pem_slice_iter(&std::fs::read(dir.join(format!("{n}.pem"))).unwrap())
                .next()
                .unwrap()
                .unwrap()
        };
        assert_eq!(role_of(&der("r1")), Some(Role::Router));
        assert_eq!(role_of(&der("a1")), Some(Role::Agent));
        assert_eq!(role_of(&der("ca")), None);
        // The DNS form, as Helm's genSignedCert writes it; both roles at once is none.
        let dns_only = |names: Vec<String>| {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(names)
                .unwrap()
                .self_signed(&key)
                .unwrap();
            role_of(cert.der())
        };
        assert_eq!(
            dns_only(vec!["agent".into(), Role::Agent.dns().into()]),
            Some(Role::Agent)
        );
        assert_eq!(
            dns_only(vec![Role::Agent.dns().into(), Role::Router.dns().into()]),
            None
        );
        assert_eq!(dns_only(vec!["agent".into()]), None);
        let a1 = der("a1");
        let (_, c) = x509_parser::parse_x509_certificate(&a1).unwrap();
        let names = format!("{:?}", c.subject_alternative_name().unwrap().unwrap().value);
        assert!(
            names.contains("a1") && !names.contains("localhost"),
            "{names}"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("a1.key")), 0o600);
        assert_eq!(mode(&dir.join("ca.key")), 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
