//! TLS (issue 11 item 4) with real processes on loopback: a TLS mill with TLS executors and
//! the CLI over https, a wrong CA, mutual TLS binding a certificate to a node id, plaintext
//! peers and stalled handshakes on TLS ports, bad certificate files. Certificates are made
//! with rcgen per test. Tests assert outcomes and counts, never durations.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{api_token, start_executor, strings, timing, wait_for, Api, Mill, BIN, TIMEOUT};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::{json, Value};

/// A certificate authority that can sign leaves.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: PathBuf,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(DnType::CommonName, format!("millrace test CA {name}"));
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let pem = dir.join(format!("{name}.pem"));
        std::fs::write(&pem, cert.pem()).unwrap();
        Ca {
            issuer: Issuer::new(params, key),
            pem,
        }
    }

    /// A leaf for `names` (DNS names or IP addresses) with `usage`: its certificate and key
    /// files, `<stem>.pem` and `<stem>-key.pem` (0600).
    fn leaf(
        &self,
        dir: &Path,
        stem: &str,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.extended_key_usages = vec![usage];
        params.distinguished_name.push(DnType::CommonName, stem);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (cert_path, key_path) = (
            dir.join(format!("{stem}.pem")),
            dir.join(format!("{stem}-key.pem")),
        );
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
        (cert_path, key_path)
    }
}

/// The certificates of one test: the mill's CA and its server certificate (for `localhost`
/// and 127.0.0.1), a CA for executors' client certificates, and a CA nobody uses.
struct Pki {
    dir: PathBuf,
    ca: Ca,
    mill_cert: PathBuf,
    mill_key: PathBuf,
    clients: Ca,
    other: Ca,
}

impl Pki {
    fn new(root: &Path) -> Pki {
        let dir = root.join("pki");
        std::fs::create_dir_all(&dir).unwrap();
        let ca = Ca::new(&dir, "ca");
        let (mill_cert, mill_key) = ca.leaf(
            &dir,
            "mill",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let clients = Ca::new(&dir, "client-ca");
        let other = Ca::new(&dir, "other-ca");
        Pki {
            dir,
            ca,
            mill_cert,
            mill_key,
            clients,
            other,
        }
    }

    /// A client certificate naming `name`, signed by the executors' CA.
    fn client(&self, name: &str) -> (PathBuf, PathBuf) {
        self.clients.leaf(
            &self.dir,
            &format!("client-{name}"),
            &[name],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// A TLS mill (mutual TLS when `mutual`); its `api` speaks https trusting the mill's CA.
fn start_tls_mill(root: &Path, pki: &Pki, mutual: bool, extra: &[&str]) -> Mill {
    let mut args = strings(&[
        "--tls-cert",
        &path(&pki.mill_cert),
        "--tls-key",
        &path(&pki.mill_key),
    ]);
    if mutual {
        args.extend(strings(&["--tls-client-ca", &path(&pki.clients.pem)]));
    }
    args.extend(strings(extra));
    args.extend(timing("5s", "2s"));
    let mut mill = common::start_mill(root, "127.0.0.1:0", &args, "info", 0);
    let https = mill.addrs.http.replacen("http://", "https://", 1);
    mill.api = Api::with_ca(&https, &api_token(&mill.data), &pki.ca.pem);
    mill
}

/// An executor dialling the TLS mill with `tls` flags.
fn start_tls_exec(root: &Path, mill: &Mill, node: &str, tls: &[String]) -> common::Proc {
    let mut extra = tls.to_vec();
    extra.extend(timing("5s", "2s"));
    start_executor(
        root,
        &mill.addrs.executor,
        node,
        1,
        &mill.data.join("token"),
        &extra,
    )
}

/// One sample of the mill's `/metrics` (0 when absent).
fn metric(mill: &Mill, name: &str) -> u64 {
    let (s, text) = mill.api.get_raw("/metrics", true);
    assert_eq!(s, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

fn rejected(mill: &Mill, reason: &str) -> u64 {
    metric(
        mill,
        &format!("millrace_preauth_rejected_total{{reason=\"{reason}\"}}"),
    )
}

/// The node ids the mill lists.
fn nodes(mill: &Mill) -> Vec<String> {
    let (s, v) = mill.api.get("/v1/nodes");
    assert_eq!(s, 200, "{v}");
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["node"].as_str().unwrap().to_string())
        .collect()
}

/// Runs the CLI against the mill's API over https.
fn cli(mill: &Mill, pki: &Pki, args: &[&str]) -> std::process::Output {
    let https = mill.addrs.http.replacen("http://", "https://", 1);
    let mut all = strings(args);
    let at = all.iter().position(|a| a == "--").unwrap_or(all.len());
    let client = strings(&[
        "--server",
        &https,
        "--tls-ca",
        &path(&pki.ca.pem),
        "--data",
        &path(&mill.data),
    ]);
    all.splice(at..at, client);
    Command::new(BIN).args(&all).output().unwrap()
}

/// Issue 11 item 4 (1): a TLS mill and an executor that trusts its CA run a job to success;
/// the CLI sees it over https (status, and submit --wait streaming the log).
#[test]
fn tls_mill_and_executor_run_a_job_and_the_cli_sees_it_over_https() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let mill = start_tls_mill(root.path(), &pki, false, &[]);
    let exec = start_tls_exec(
        root.path(),
        &mill,
        "exec-a",
        &strings(&["--tls-ca", &path(&pki.ca.pem)]),
    );
    wait_for("exec-a's session over TLS", || {
        mill.api.ready("exec-a").then_some(())
    });
    let id = mill.api.submit(&json!({"command": "echo over-tls"}));
    let done = mill.api.wait_done(id);
    assert_eq!(done["state"], "success", "{done}");
    assert_eq!(done["node"], "exec-a", "{done}");

    let out = cli(&mill, &pki, &["status", &id.to_string()]);
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "success", "{v}");

    let out = cli(&mill, &pki, &["submit", "--wait", "--", "echo", "hello"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");

    let (s, list) = mill.api.get("/v1/jobs?state=success&limit=10");
    assert_eq!(s, 200);
    assert_eq!(list["jobs"].as_array().unwrap().len(), 2, "{list}");
    assert!(metric(&mill, "millrace_preauth_admitted_total") >= 1);
    assert!(
        exec.logs().contains("tls=true"),
        "the executor did not log a TLS connection:\n{}",
        exec.logs()
    );
}

/// Issue 11 item 4 (1), the server name: `--tls-server-name` overrides the host of --mill
/// (the mill's certificate names `localhost`; a name it does not carry fails).
#[test]
fn tls_server_name_is_what_the_mills_certificate_is_checked_against() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let mill = start_tls_mill(root.path(), &pki, false, &[]);
    let ca = path(&pki.ca.pem);
    let _good = start_tls_exec(
        root.path(),
        &mill,
        "named",
        &strings(&["--tls-ca", &ca, "--tls-server-name", "localhost"]),
    );
    let bad = start_tls_exec(
        root.path(),
        &mill,
        "misnamed",
        &strings(&["--tls-ca", &ca, "--tls-server-name", "mill.elsewhere"]),
    );
    wait_for("the executor with the right server name", || {
        mill.api.ready("named").then_some(())
    });
    wait_for("the misnamed executor's handshake error", || {
        bad.logs()
            .contains("TLS handshake with the mill failed")
            .then_some(())
    });
    assert_eq!(nodes(&mill), vec!["named".to_string()]);
}

/// Issue 11 item 4 (2): an executor that trusts another CA fails the handshake; it logs the
/// error, the mill counts a `tls_handshake` rejection and no session exists.
#[test]
fn an_executor_trusting_another_ca_fails_the_handshake_and_gets_no_session() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let mill = start_tls_mill(root.path(), &pki, false, &[]);
    let exec = start_tls_exec(
        root.path(),
        &mill,
        "wrong-ca",
        &strings(&["--tls-ca", &path(&pki.other.pem)]),
    );
    wait_for("the handshake error in the executor's log", || {
        let logs = exec.logs();
        (logs.contains("TLS handshake with the mill failed") && logs.contains("UnknownIssuer"))
            .then_some(())
    });
    wait_for("the mill to count the failed handshake", || {
        (rejected(&mill, "tls_handshake") >= 1).then_some(())
    });
    wait_for("the failed handshake in the mill's log", || {
        mill.proc.logs().contains("tls_handshake").then_some(())
    });
    assert!(nodes(&mill).is_empty(), "{:?}", nodes(&mill));
    assert_eq!(metric(&mill, "millrace_preauth_admitted_total"), 0);
    assert!(!exec.logs().contains("connected to the mill"));
}

/// Issue 11 item 4 (3): with `--tls-client-ca`, an executor whose certificate names its node
/// id gets a session and runs a job.
#[test]
fn mtls_admits_an_executor_whose_certificate_names_its_node_id() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let mill = start_tls_mill(root.path(), &pki, true, &[]);
    let (cert, key) = pki.client("exec-a");
    let _exec = start_tls_exec(
        root.path(),
        &mill,
        "exec-a",
        &strings(&[
            "--tls-ca",
            &path(&pki.ca.pem),
            "--tls-cert",
            &path(&cert),
            "--tls-key",
            &path(&key),
        ]),
    );
    wait_for("exec-a's mutual-TLS session", || {
        mill.api.ready("exec-a").then_some(())
    });
    let id = mill.api.submit(&json!({"command": "true"}));
    assert_eq!(mill.api.wait_done(id)["state"], "success");
    assert!(metric(&mill, "millrace_preauth_admitted_total") >= 1);
    assert_eq!(rejected(&mill, "identity"), 0);
    assert_eq!(rejected(&mill, "tls_handshake"), 0);
}

/// Issue 11 item 4 (3): with `--tls-client-ca`, a certificate that names another node id is
/// refused at its Hello (the executor hears why), and an executor without a client
/// certificate fails the handshake; neither gets a session.
#[test]
fn mtls_refuses_another_nodes_certificate_and_no_certificate() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let mill = start_tls_mill(root.path(), &pki, true, &[]);
    let ca = path(&pki.ca.pem);
    let (cert_b, key_b) = pki.client("exec-b");
    let impostor = start_tls_exec(
        root.path(),
        &mill,
        "exec-c",
        &strings(&[
            "--tls-ca",
            &ca,
            "--tls-cert",
            &path(&cert_b),
            "--tls-key",
            &path(&key_b),
        ]),
    );
    wait_for("the refusal in the impostor's log", || {
        let logs = impostor.logs();
        (logs.contains("the mill refused this executor") && logs.contains("not this node id"))
            .then_some(())
    });
    wait_for("the mill to count the identity rejection", || {
        (rejected(&mill, "identity") >= 1).then_some(())
    });

    let anonymous = start_tls_exec(root.path(), &mill, "exec-d", &strings(&["--tls-ca", &ca]));
    wait_for(
        "the mill to count the handshake without a certificate",
        || (rejected(&mill, "tls_handshake") >= 1).then_some(()),
    );
    wait_for(
        "the anonymous executor to hear the handshake failed",
        || {
            let logs = anonymous.logs();
            (logs.contains("CertificateRequired")
                || logs.contains("TLS handshake with the mill failed"))
            .then_some(())
        },
    );
    assert!(nodes(&mill).is_empty(), "{:?}", nodes(&mill));
    assert_eq!(metric(&mill, "millrace_preauth_admitted_total"), 0);
}

/// Issue 11 item 4 (4): plaintext peers get nothing from either TLS port: an HTTP request
/// on the API port gets no HTTP answer, a plaintext executor gets no session.
#[test]
fn plaintext_peers_get_nothing_from_tls_ports() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let mill = start_tls_mill(root.path(), &pki, false, &[]);
    let http_addr = mill.addrs.http.trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(&http_addr).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(
        !out.starts_with(b"HTTP/"),
        "a plaintext request got an HTTP answer: {:?}",
        String::from_utf8_lossy(&out)
    );
    let plain = Api::new(&mill.addrs.http, &api_token(&mill.data));
    assert_eq!(plain.get_raw("/health", false).0, 0);
    assert_eq!(mill.api.get_raw("/health", false).0, 200);

    let exec = start_executor(
        root.path(),
        &mill.addrs.executor,
        "plain",
        1,
        &mill.data.join("token"),
        &timing("5s", "2s"),
    );
    wait_for(
        "the mill to count the plaintext executor's failed handshake",
        || (rejected(&mill, "tls_handshake") >= 1).then_some(()),
    );
    assert!(nodes(&mill).is_empty(), "{:?}", nodes(&mill));
    drop(exec);
}

/// Issue 11 item 4, bounds: a peer that starts a handshake and stalls is closed by the
/// `--hello-timeout` on the executor port and the `--http-header-timeout` on the API.
#[test]
fn stalled_handshakes_are_closed_by_the_existing_timeouts() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let mill = start_tls_mill(
        root.path(),
        &pki,
        false,
        &["--hello-timeout", "1s", "--http-header-timeout", "1s"],
    );
    let http_addr = mill.addrs.http.trim_start_matches("http://").to_string();
    for addr in [mill.addrs.executor.clone(), http_addr] {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        // A TLS handshake record header announcing 512 bytes, then nothing.
        s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "{addr}: the stalled handshake was not closed");
    }
    assert_eq!(rejected(&mill, "timeout"), 1);
}

/// Issue 11 item 4: unusable certificate files stop the mill and the executor with an error
/// naming the flag and the path.
#[test]
fn bad_certificate_files_are_named_with_their_flag() {
    let root = tempfile::tempdir().unwrap();
    let pki = Pki::new(root.path());
    let junk = root.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let missing = root.path().join("missing.pem");
    let data = root.path().join("mill");
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let base = |cert: &Path, key: &Path| {
        strings(&[
            "mill",
            "--data",
            &path(&data),
            "--executor-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--tls-cert",
            &path(cert),
            "--tls-key",
            &path(key),
        ])
    };
    let args = base(&missing, &pki.mill_key);
    let err = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains("--tls-cert") && err.contains("missing.pem"),
        "{err}"
    );
    let args = base(&pki.mill_cert, &junk);
    let err = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains("--tls-key") && err.contains("junk.pem"),
        "{err}"
    );
    // A key that is not the certificate's.
    let (_, other_key) = pki.client("someone");
    let args = base(&pki.mill_cert, &other_key);
    let err = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("--tls-cert/--tls-key"), "{err}");
    let mut args = base(&pki.mill_cert, &pki.mill_key);
    args.extend(strings(&["--tls-client-ca", &path(&junk)]));
    let err = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains("--tls-client-ca") && err.contains("junk.pem"),
        "{err}"
    );
    assert!(!data.join("addr.json").exists(), "the mill listened anyway");

    let token = root.path().join("token");
    std::fs::write(&token, "some-token\n").unwrap();
    let err = run(&[
        "executor",
        "--node-id",
        "x",
        "--data",
        &path(&root.path().join("x")),
        "--token-file",
        &path(&token),
        "--tls-ca",
        &path(&junk),
    ]);
    assert!(
        err.contains("--tls-ca") && err.contains("junk.pem"),
        "{err}"
    );
}
