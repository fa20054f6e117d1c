//! accel's TCPStore client against torch's own server, and torch's client
//! against accel's server, with the real torch 2.13 (`make torch-venv`).
//! Without that interpreter the tests print why and skip; under CI they fail.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, ErrorKind, Store};
use accel_rendezvous::{TorchStore, TorchStoreServer};

const T: Duration = Duration::from_secs(20);

use accel_test_support::python;

/// `ACCEL_TORCH_PYTHON`, else the workspace's `.accel-cache/torch-venv`.
fn torch_python() -> Option<PathBuf> {
    let venvs = python::torch_python_candidates(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    python::python_from(
        venvs,
        "import torch.distributed",
        "`make torch-venv` makes it",
    )
}

/// A child killed when dropped, with a hard deadline on its output.
struct Py {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Py {
    fn start(python: &Path, script: &str, args: &[&str]) -> Py {
        let mut child = Command::new(python)
            .arg("-c")
            .arg(script)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Py { child, out }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        assert!(
            !l.is_empty(),
            "the Python side ended early (see its stderr above)"
        );
        l.trim().to_string()
    }

    fn finish(mut self) {
        let deadline = Instant::now() + T;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "the Python side failed: {st}");
                return;
            }
            assert!(Instant::now() < deadline, "the Python side did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const TORCH_SERVER: &str = r#"
import datetime, torch.distributed as d
s = d.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
               timeout=datetime.timedelta(seconds=20))
print(s.port, flush=True)
v = s.get("from_rust")
s.set("from_torch", v + b"!")
s.wait(["rust_done"])
assert s.get("counter") == b"3", s.get("counter")
print("ok", flush=True)
"#;

#[test]
fn accel_client_against_torchs_server() {
    let Some(py) = torch_python() else { return };
    let mut p = Py::start(&py, TORCH_SERVER, &[]);
    let port: u16 = p.line().parse().unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let c = TorchStore::connect(addr, T).unwrap();

    // Keys meet torch's own client under its prefix.
    c.set("from_rust", b"hi").unwrap();
    assert_eq!(c.get("from_torch", T).unwrap(), b"hi!");

    assert_eq!(c.add("counter", 5).unwrap(), 5);
    assert_eq!(c.add("counter", -2).unwrap(), 3);
    assert_eq!(
        c.compare_set("cas", None, b"one").unwrap(),
        CasOutcome::Swapped
    );
    assert_eq!(
        c.compare_set("cas", Some(b"x"), b"two").unwrap(),
        CasOutcome::Current(Some(b"one".to_vec()))
    );
    assert_eq!(
        c.compare_set("cas", Some(b"one"), b"two").unwrap(),
        CasOutcome::Swapped
    );
    assert_eq!(
        c.compare_set("absent", Some(b"1"), b"2").unwrap(),
        CasOutcome::Current(None)
    );
    assert_eq!(c.try_get("absent").unwrap(), None);
    c.set("empty", b"").unwrap();
    assert_eq!(c.try_get("empty").unwrap(), Some(vec![]));
    assert!(c.check(&["cas", "counter"]).unwrap());
    assert!(!c.check(&["cas", "nope"]).unwrap());
    assert!(c.delete("empty").unwrap());
    assert!(!c.delete("empty").unwrap());
    c.append("ap", b"a").unwrap();
    c.append("ap", b"b").unwrap();
    c.multi_set(&[("m1", b"1"), ("m2", b"2")]).unwrap();
    assert_eq!(
        c.multi_get(&["m1", "m2", "ap"], T).unwrap(),
        vec![b"1".to_vec(), b"2".to_vec(), b"ab".to_vec()]
    );
    assert!(c.num_keys().unwrap() >= 6);
    let keys = c.list_keys().unwrap();
    for k in [
        "from_rust",
        "from_torch",
        "counter",
        "cas",
        "m1",
        "m2",
        "ap",
    ] {
        assert!(keys.iter().any(|x| x == k), "{k} not in {keys:?}");
    }
    c.ping().unwrap();
    c.queue_push("q", b"x").unwrap();
    assert_eq!(c.queue_len("q").unwrap(), 1);
    assert_eq!(c.queue_pop("q", Some(T)).unwrap().unwrap(), b"x");
    assert_eq!(c.queue_pop("q", None).unwrap(), None);

    // wait with a timeout: cancelled on torch's server, the client goes on.
    let start = Instant::now();
    let e = c
        .wait(&["cas", "never"], Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains("never") && !m.contains("cas,"), "{m}");
    assert!(start.elapsed() < Duration::from_secs(5));
    let e = c.get("never", Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");

    // A client that dies in the middle of a wait leaves the server serving.
    let mut dying = TcpStream::connect(addr).unwrap();
    let mut w = vec![0u8];
    w.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
    w.push(6);
    w.extend_from_slice(&1u64.to_le_bytes());
    w.extend_from_slice(&2u64.to_le_bytes());
    w.extend_from_slice(b"/z");
    dying.write_all(&w).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(dying);

    // torch's server-side barrier, two clients.
    let c2 = TorchStore::connect(addr, T).unwrap();
    let t = std::thread::spawn(move || c2.server_barrier("bar", 2, T));
    c.server_barrier("bar", 2, T).unwrap();
    t.join().unwrap().unwrap();
    let e = c
        .server_barrier("lonely", 2, Duration::from_millis(100))
        .unwrap_err();
    assert!(e.to_string().contains("1 of 2"), "{e}");

    c.set("z", b"late").unwrap();
    assert_eq!(c.get("z", T).unwrap(), b"late");
    c.set("rust_done", b"1").unwrap();
    assert_eq!(p.line(), "ok");
    p.finish();
}

const TORCH_CLIENT: &str = r#"
import datetime, subprocess, sys, time, torch.distributed as d
port = int(sys.argv[1])
s = d.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
               timeout=datetime.timedelta(seconds=20))
assert s.get("from_rust") == b"hello"
s.set("k", "v"); assert s.get("k") == b"v"
assert s.add("c", 5) == 5 and s.add("c", -2) == 3
assert s.compare_set("cas", "", "one") == b"one"
assert s.compare_set("cas", "x", "two") == b"one"
assert s.compare_set("cas", "one", "two") == b"two"
assert s.check(["k", "c"]) and not s.check(["nope"])
s.append("ap", "a"); s.append("ap", "b"); assert s.get("ap") == b"ab"
s.multi_set(["m1", "m2"], ["1", "2"]); assert s.multi_get(["m1", "m2"]) == [b"1", b"2"]
assert s.delete_key("k") and not s.delete_key("k")
assert s.num_keys() >= 6, s.num_keys()
assert {"from_rust", "c", "cas", "ap", "m1", "m2"} <= set(s.list_keys()), s.list_keys()
s.queue_push("q", "a"); assert s.queue_len("q") == 1; assert s.queue_pop("q") == b"a"
t0 = time.time()
try:
    s.wait(["never"], datetime.timedelta(milliseconds=300))
    raise SystemExit("wait did not time out")
except RuntimeError as e:
    assert "timeout" in str(e).lower(), e
assert time.time() - t0 < 5
# A client killed in the middle of a wait.
child = subprocess.Popen([sys.executable, "-c",
    "import datetime, torch.distributed as d\n"
    f"s = d.TCPStore('127.0.0.1', {port}, is_master=False, wait_for_workers=False)\n"
    "print('waiting', flush=True)\n"
    "s.wait(['forever'], datetime.timedelta(seconds=60))"], stdout=subprocess.PIPE)
assert child.stdout.readline().strip() == b"waiting"
time.sleep(0.3); child.kill(); child.wait()
s.set("after", "ok"); assert s.get("after") == b"ok"
s.barrier("bar", 2, datetime.timedelta(seconds=20))
s.set("from_torch", "done")
print("ok", flush=True)
"#;

#[test]
fn torchs_client_against_accels_server() {
    let Some(py) = torch_python() else { return };
    let server = TorchStoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let c = TorchStore::connect(server.local_addr(), T).unwrap();
    c.set("from_rust", b"hello").unwrap();
    let port = server.local_addr().port().to_string();
    let mut p = Py::start(&py, TORCH_CLIENT, &[&port]);
    // Rust is the barrier's second party.
    c.server_barrier("bar", 2, T).unwrap();
    assert_eq!(p.line(), "ok");
    p.finish();
    assert_eq!(c.get("from_torch", T).unwrap(), b"done");
    assert_eq!(c.get("c", T).unwrap(), b"3");
    assert_eq!(c.try_get("k").unwrap(), None);
    assert_eq!(c.get("after", T).unwrap(), b"ok");
}
