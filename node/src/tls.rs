//! TLS (issue 11 item 4): loading PEM files into rustls configurations for the mill's two
//! listeners, the executor's dialler and the CLI client, and the mutual-TLS identity rule.
//!
//! Everything runs on rustls with the *ring* provider, handed in explicitly: no process-wide
//! default provider is installed or relied on.
//!
//! **Identity (mTLS).** With `--tls-client-ca`, an executor must present a certificate signed
//! by that CA whose subject alternative names include a **DNS name equal to its node id**
//! (exactly, case-sensitively; wildcards and the subject CN are not considered). The node id
//! must therefore also be a valid DNS name (letters, digits, `-`, `_`, dots between labels of
//! at most 63 bytes, not all digits). A `Hello` whose node id the certificate does not name is
//! refused before the mill driver hears of it (see `preauth`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A TLS file or setting that could not be used; every message names the setting and the path.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read or holds no valid PEM of the expected kind.
    #[error("{setting} {}: {reason}", path.display())]
    File {
        /// The flag, e.g. `--tls-cert`.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The files were readable but rustls refused them together (key does not match, ...).
    #[error("{setting}: {reason}")]
    Config {
        /// The flag(s) involved.
        setting: &'static str,
        /// What rustls said.
        reason: String,
    },
}

/// The crypto provider used everywhere: ring.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in the PEM file at `path`; at least one.
pub fn load_certs(
    setting: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file = |reason: String| TlsError::File {
        setting,
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| file(format!("cannot read: {e}")))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(file("holds no PEM CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The private key (PKCS#8, PKCS#1 or SEC1 PEM) in the file at `path`.
pub fn load_key(setting: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    crate::node::warn_if_readable_by_others(path);
    let file = |reason: String| TlsError::File {
        setting,
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| file(format!("cannot read: {e}")))?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => file("holds no PEM PRIVATE KEY block".into()),
        other => file(format!("not a PEM private key file: {other}")),
    })
}

/// The certificates of the CA file at `path`, each checked to be usable as a trust anchor.
pub fn load_ca(
    setting: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = load_certs(setting, path)?;
    roots_of(setting, path, &certs)?;
    Ok(certs)
}

fn roots_of(
    setting: &'static str,
    path: &Path,
    certs: &[CertificateDer<'static>],
) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certs {
        store.add(cert.clone()).map_err(|e| TlsError::File {
            setting,
            path: path.to_path_buf(),
            reason: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(Arc::new(store))
}

/// A root store holding every certificate of the CA file at `path`.
fn roots(setting: &'static str, path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    roots_of(setting, path, &load_certs(setting, path)?)
}

/// The mill's TLS files, as given on the command line.
#[derive(Debug, Clone)]
pub struct MillTlsFiles {
    /// `--tls-cert`: the mill's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// `--tls-key`: its private key (PEM).
    pub key: PathBuf,
    /// `--tls-client-ca`: when set, executors must present a certificate signed by this CA
    /// that names their node id (mutual TLS on the executor port only).
    pub client_ca: Option<PathBuf>,
}

/// The mill's two server configurations.
#[derive(Clone)]
pub struct MillTls {
    /// For the executor port (client certificates required when `--tls-client-ca` is set).
    pub executor: Arc<ServerConfig>,
    /// For the HTTP API (never asks for client certificates; the API has its bearer token).
    pub http: Arc<ServerConfig>,
    /// Whether executors must present a certificate naming their node id.
    pub mutual: bool,
}

impl std::fmt::Debug for MillTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MillTls")
            .field("mutual", &self.mutual)
            .finish_non_exhaustive()
    }
}

impl MillTlsFiles {
    /// Loads the files and builds both server configurations.
    pub fn load(&self) -> Result<MillTls, TlsError> {
        let certs = load_certs("--tls-cert", &self.cert)?;
        let key = load_key("--tls-key", &self.key)?;
        let provider = provider();
        let builder = || {
            ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| TlsError::Config {
                    setting: "--tls-cert",
                    reason: e.to_string(),
                })
        };
        let with_cert =
            |b: rustls::ConfigBuilder<ServerConfig, rustls::server::WantsServerCert>| {
                b.with_single_cert(certs.clone(), key.clone_key())
                    .map_err(|e| TlsError::Config {
                        setting: "--tls-cert/--tls-key",
                        reason: e.to_string(),
                    })
            };
        let mut http = with_cert(builder()?.with_no_client_auth())?;
        http.alpn_protocols = vec![b"http/1.1".to_vec()];
        let executor = match &self.client_ca {
            None => with_cert(builder()?.with_no_client_auth())?,
            Some(ca) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    roots("--tls-client-ca", ca)?,
                    provider.clone(),
                )
                .build()
                .map_err(|e| TlsError::Config {
                    setting: "--tls-client-ca",
                    reason: e.to_string(),
                })?;
                with_cert(builder()?.with_client_cert_verifier(verifier))?
            }
        };
        Ok(MillTls {
            executor: Arc::new(executor),
            http: Arc::new(http),
            mutual: self.client_ca.is_some(),
        })
    }
}

/// An executor's TLS files.
#[derive(Debug, Clone)]
pub struct ExecTlsFiles {
    /// `--tls-ca`: the CA that signed the mill's certificate.
    pub ca: PathBuf,
    /// `--tls-cert`/`--tls-key`: this executor's client certificate (mutual TLS).
    pub client: Option<(PathBuf, PathBuf)>,
    /// `--tls-server-name`: the name the mill's certificate must carry; default the host of
    /// `--mill`.
    pub server_name: Option<String>,
}

/// What an executor dials with.
#[derive(Clone)]
pub struct ExecTls {
    /// The client configuration.
    pub config: Arc<ClientConfig>,
    /// The name the mill's certificate is checked against.
    pub server_name: ServerName<'static>,
}

impl std::fmt::Debug for ExecTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl ExecTlsFiles {
    /// Loads the files; `mill` (`host:port`) gives the server name unless one is set.
    pub fn load(&self, mill: &str) -> Result<ExecTls, TlsError> {
        let (name, setting) = match &self.server_name {
            Some(n) => (n.clone(), "--tls-server-name"),
            None => (host_of(mill).to_string(), "--mill"),
        };
        let server_name = ServerName::try_from(name.clone()).map_err(|e| TlsError::Config {
            setting,
            reason: format!("{name:?} is not a DNS name or IP address to check the mill's certificate against: {e}"),
        })?;
        let config = client_config("--tls-ca", &self.ca, self.client.as_ref())?;
        Ok(ExecTls {
            config,
            server_name,
        })
    }
}

/// A client configuration trusting the CA file at `ca`, with an optional client certificate.
pub fn client_config(
    ca_setting: &'static str,
    ca: &Path,
    client: Option<&(PathBuf, PathBuf)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config {
            setting: ca_setting,
            reason: e.to_string(),
        })?
        .with_root_certificates(roots(ca_setting, ca)?);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs("--tls-cert", cert)?, load_key("--tls-key", key)?)
            .map_err(|e| TlsError::Config {
                setting: "--tls-cert/--tls-key",
                reason: e.to_string(),
            })?,
    };
    Ok(Arc::new(config))
}

/// The host part of `host:port` (`[v6]:port` too); the whole string when there is no port.
pub fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(h, _)| h);
    }
    match addr.rsplit_once(':') {
        // More than one colon and no brackets: a bare IPv6 address.
        Some((h, _)) if !h.contains(':') => h,
        _ => addr,
    }
}

/// Checks that the (already verified) client certificate `cert` names `node` as a DNS subject
/// alternative name: exactly, case-sensitively, no wildcards. `Err` says why not.
pub fn cert_names_node(cert: &CertificateDer<'_>, node: &str) -> Result<(), String> {
    let ee = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| format!("the client certificate cannot be parsed: {e}"))?;
    let names: Vec<&str> = ee.valid_dns_names().collect();
    let name = rustls_pki_types::DnsName::try_from(node)
        .map(|d| ServerName::DnsName(d.to_owned()))
        .map_err(|_| {
            format!("node id {node:?} is not a DNS name, so no client certificate can name it")
        })?;
    // webpki's own matching first (the supported way), then the stricter exact equality.
    let matched = ee.verify_is_valid_for_subject_name(&name).is_ok() && names.contains(&node);
    if matched {
        Ok(())
    } else {
        Err(format!(
            "node {node:?}: the client certificate names {names:?}, not this node id"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_for(names: &[&str]) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().unwrap();
        let params =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn mtls_identity_is_an_exact_dns_san() {
        let c = cert_for(&["exec-1", "other.example"]);
        assert!(cert_names_node(&c, "exec-1").is_ok());
        assert!(cert_names_node(&c, "other.example").is_ok());
        let e = cert_names_node(&c, "exec-2").unwrap_err();
        assert!(e.contains("exec-1") && e.contains("exec-2"), "{e}");
        // DNS matching is case-insensitive; node ids are not.
        assert!(cert_names_node(&c, "EXEC-1").is_err());
    }

    #[test]
    fn mtls_identity_ignores_wildcards() {
        let c = cert_for(&["*.pool"]);
        assert!(cert_names_node(&c, "a.pool").is_err());
    }

    #[test]
    fn mtls_identity_needs_a_dns_shaped_node_id() {
        let c = cert_for(&["123"]);
        let e = cert_names_node(&c, "123").unwrap_err();
        assert!(e.contains("not a DNS name"), "{e}");
    }

    #[test]
    fn host_of_strips_the_port() {
        assert_eq!(host_of("mill.example:7071"), "mill.example");
        assert_eq!(host_of("127.0.0.1:7071"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7071"), "::1");
        assert_eq!(host_of("::1"), "::1");
        assert_eq!(host_of("mill"), "mill");
    }

    #[test]
    fn bad_files_name_the_setting_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pem");
        let e = load_certs("--tls-cert", &missing).unwrap_err().to_string();
        assert!(
            e.starts_with("--tls-cert ") && e.contains("nope.pem"),
            "{e}"
        );
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not pem at all\n").unwrap();
        let e = load_certs("--tls-ca", &junk).unwrap_err().to_string();
        assert!(e.contains("--tls-ca") && e.contains("junk.pem"), "{e}");
        let e = load_key("--tls-key", &junk).unwrap_err().to_string();
        assert!(e.contains("--tls-key") && e.contains("junk.pem"), "{e}");
    }
}
