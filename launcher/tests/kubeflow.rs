//! Kubeflow Trainer's progress posts (KEP-2779): `accel launch` with
//! `KUBEFLOW_TRAINER_STATUS_URL` posts rank 0's progress to a local HTTPS
//! server (a Python `http.server` behind TLS, with a CA and a server
//! certificate made by `openssl` for the test), with the bearer token; a
//! server that never answers does not fail or hold up the run.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// The status server: answers each POST with 200 and appends its
/// Authorization header and body, one JSON line each, to `posts`.
const SERVER: &str = r#"
import http.server, json, ssl, sys
posts, cert, key = sys.argv[1], sys.argv[2], sys.argv[3]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(posts, "a") as f:
            f.write(json.dumps({"auth": self.headers.get("Authorization"), "body": json.loads(body)}) + "\n")
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
s.socket = ctx.wrap_socket(s.socket, server_side=True)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

/// Kills the server when the test ends.
struct Server(std::process::Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `accel launch -n 2` of the training demo (2 epochs), posting to `url`.
fn train_posting(dir: &Path, url: &str) -> Run {
    let ckpt = dir.join("ck");
    let mut cmd = command(&argv(
        "launch -n 2 --timeout 30s --",
        &[
            train_bin().to_str().unwrap(),
            "--epochs",
            "2",
            "--train-len",
            "400",
            "--save-every",
            "0",
            "--step-delay-ms",
            "20",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    ));
    std::fs::write(dir.join("token"), "secret-token\n").unwrap();
    cmd.env("KUBEFLOW_TRAINER_STATUS_URL", url)
        .env("KUBEFLOW_TRAINER_STATUS_CA_CERT", dir.join("ca.pem"))
        .env("KUBEFLOW_TRAINER_STATUS_TOKEN", dir.join("token"))
        .env("ACCEL_KUBEFLOW_STATUS_EVERY", "300ms")
        .env("ACCEL_STATUS_EVERY", "200ms")
        .env("ACCEL_DUMP_DIR", dir.join("dumps"));
    start(cmd).finish(Duration::from_secs(120))
}

#[test]
fn progress_reaches_the_status_server_with_the_token() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    accel_test_support::tls::certificates(dir);
    let posts = dir.join("posts.jsonl");
    let mut child = Command::new("python3")
        .args(["-c", SERVER])
        .arg(&posts)
        .arg(dir.join("server.pem"))
        .arg(dir.join("server.key"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut port = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let _server = Server(child);
    let url = format!("https://127.0.0.1:{}/status", port.trim());
    let run = train_posting(dir, &url);
    run.code_is(0);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&posts)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        !lines.is_empty(),
        "no post reached the server:\n{}",
        run.all()
    );
    for l in &lines {
        assert_eq!(l["auth"], "Bearer secret-token", "{l}");
    }
    // The last post is the run's end: every step done, the loss logged.
    let last = &lines.last().unwrap()["body"]["trainerStatus"];
    let metric = |name: &str| {
        last["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == name)
            .and_then(|m| m["value"].as_str().map(String::from))
    };
    let total = metric("total_steps").unwrap_or_else(|| panic!("no total_steps in {last}"));
    assert_eq!(metric("step").as_deref(), Some(total.as_str()), "{last}");
    assert_eq!(last["progressPercentage"], 100, "{last}");
    let loss: f64 = metric("loss").expect("loss").parse().unwrap();
    assert!(loss.is_finite(), "{last}");
    assert!(
        last["lastUpdatedTime"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{last}"
    );
}

/// A server that accepts connections and never answers: each post waits
/// for its timeout, on the launcher's reporting thread; the run still ends
/// as it would have, and says once that the posts fail.
#[test]
fn a_status_server_that_never_answers_does_not_fail_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    accel_test_support::tls::certificates(dir);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for c in silent.incoming().take(4) {
            conns.push(c);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let run = train_posting(dir, &format!("https://127.0.0.1:{port}/status"));
    run.code_is(0);
    run.has_stderr("the Kubeflow status post to https://127.0.0.1:");
    assert_eq!(
        run.stderr.matches("the Kubeflow status post to").count(),
        1,
        "said once:\n{}",
        run.all()
    );
    drop(held);
}
