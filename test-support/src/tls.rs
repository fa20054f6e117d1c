//! Certificates for tests that run TLS servers (an etcd member, a status
//! server): a CA and certificates it signed for 127.0.0.1, made with
//! `openssl` (the Makefile's setup installs it), P-256 keys.

use std::path::Path;
use std::process::Command;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs (Debian's openssl package; the Makefile's setup installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const EC: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
];

/// In `dir`: a CA (`ca.pem`), and certificates it signed for 127.0.0.1:
/// a server's (`server.pem`, `server.key`; also good as a client's) and a
/// client's (`client.pem`, `client.key`).
///
/// # Panics
/// When openssl fails.
pub fn certificates(dir: &Path) {
    let mut ca = vec!["req", "-x509"];
    ca.extend(EC);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=accel test CA",
    ]);
    openssl(dir, &ca);
    for (name, usage) in [
        ("server", "serverAuth,clientAuth"),
        ("client", "clientAuth"),
    ] {
        let ext = format!("{name}.ext");
        std::fs::write(
            dir.join(&ext),
            format!(
                "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n"
            ),
        )
        .expect("an extension file");
        let (key, csr, pem) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        let mut req = vec!["req"];
        req.extend(EC);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", "/CN=127.0.0.1"]);
        openssl(dir, &req);
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
        );
    }
}
