//! `save_model` and `save_state_to` replace a folder so that a process
//! killed at any step of the swap leaves the old weights or the new ones
//! (issue 32, item 1): a child process saves new weights over old ones and
//! exits at one step of the swap (a hook in `accel_sharding::swap`, no
//! timing); the parent then loads and must get old or new, whole.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accel_sharding::{set_one_step_swap, set_swap_hook, SwapStep};

mod common;
use common::{single, Linear};

/// The child's orders: `<dir>|<kind>|<step>|<one_step>|<limit>`.
const CHILD: &str = "ACCEL_TEST_SWAP_CHILD";
/// Exit code of a child that stopped at its step.
const KILLED: i32 = 77;
/// Exit code of a child whose save ended without reaching its step.
const NOT_REACHED: i32 = 3;

const ONE_STEP: &[SwapStep] = &[SwapStep::Sealed, SwapStep::Exchanged, SwapStep::Synced];
const TWO_RENAMES: &[SwapStep] = &[
    SwapStep::Sealed,
    SwapStep::MovedAside,
    SwapStep::MovedIn,
    SwapStep::Synced,
];

fn model(v: f32) -> Linear {
    let mut m = Linear::new(5);
    m.w.iter_mut().for_each(|x| *x = v);
    m.b[0] = v;
    m
}

fn kill_here(s: SwapStep) {
    let spec = std::env::var(CHILD).unwrap_or_default();
    if spec.split('|').nth(2) == Some(format!("{s:?}").as_str()) {
        // No destructor runs, as under kill -9.
        std::process::exit(KILLED);
    }
}

/// A fresh accelerator each time: prepared objects are keyed by prepare order.
fn save(kind: &str, v: f32, dir: &Path, limit: u64) {
    let acc = single();
    match kind {
        "model" => {
            acc.save_model(&model(v), dir, limit).unwrap();
        }
        _ => {
            let m = acc.prepare_model(model(v)).unwrap();
            acc.save_state_to(dir, &[&m]).unwrap();
        }
    }
}

/// What `dir` loads as: the value every parameter holds.
fn load(kind: &str, dir: &Path) -> f32 {
    let acc = single();
    let flat = match kind {
        "model" => {
            let mut m = model(0.0);
            acc.load_model(&mut m, dir)
                .unwrap_or_else(|e| panic!("load_model failed: {e}"));
            m.flat()
        }
        _ => {
            let mut m = acc.prepare_model(model(0.0)).unwrap();
            acc.load_state(dir, &mut [&mut m])
                .unwrap_or_else(|e| panic!("load_state failed: {e}"));
            m.flat()
        }
    };
    assert!(
        flat.iter().all(|x| *x == flat[0]),
        "a mix of generations: {flat:?}"
    );
    flat[0]
}

/// Not a test of its own: the child process of the test below.
#[test]
fn swap_child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let f: Vec<&str> = spec.split('|').collect();
    set_one_step_swap(f[3] == "1");
    set_swap_hook(Some(kill_here));
    save(f[1], 2.0, Path::new(f[0]), f[4].parse().unwrap());
    std::process::exit(NOT_REACHED);
}

/// Run the child under a hard deadline; its exit code.
fn run_child(spec: &str) -> i32 {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "swap_child", "--test-threads=1", "--nocapture"])
        .env(CHILD, spec)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the child saving {spec} did not end within 60 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn hidden_leftovers(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn a_save_killed_at_every_step_of_the_swap_leaves_the_old_or_the_new_weights() {
    // (kind, shard limit): one file, shards, a save_state checkpoint.
    let cases = [("model", 1 << 20), ("model", 12), ("state", 0)];
    let mut checked = 0;
    for (kind, limit) in cases {
        for (one_step, steps) in [(true, ONE_STEP), (false, TWO_RENAMES)] {
            for &step in steps {
                let what =
                    format!("{kind} (limit {limit}), one step {one_step}, killed at {step:?}");
                let tmp = tempfile::tempdir().unwrap();
                let dir = tmp.path().join("weights");
                save(kind, 1.0, &dir, limit);
                let spec = format!(
                    "{}|{kind}|{step:?}|{}|{limit}",
                    dir.display(),
                    u8::from(one_step)
                );
                match run_child(&spec) {
                    KILLED => {}
                    NOT_REACHED if step == SwapStep::Exchanged => {
                        println!("{what}: this file system has no RENAME_EXCHANGE; the save took two renames");
                        continue;
                    }
                    code => panic!("{what}: the child exited with {code}"),
                }
                if step == SwapStep::Synced {
                    // A kill while the old folder was being removed: leave
                    // it half removed.
                    for left in hidden_leftovers(tmp.path()) {
                        let d = tmp.path().join(left);
                        let f = std::fs::read_dir(&d).unwrap().next().unwrap().unwrap();
                        if f.file_type().unwrap().is_file() {
                            std::fs::remove_file(f.path()).unwrap();
                        }
                    }
                }
                // Before the new folder is in place the old one loads;
                // from then on the new one (the two-rename path's gap is
                // completed by the loader).
                let want = if step == SwapStep::Sealed { 1.0 } else { 2.0 };
                assert_eq!(load(kind, &dir), want, "{what}");
                assert_eq!(load(kind, &dir), want, "{what}: a second load");
                // The next save finishes cleanly and leaves no leftovers.
                save(kind, 3.0, &dir, limit);
                assert_eq!(load(kind, &dir), 3.0, "{what}: the next save");
                assert_eq!(hidden_leftovers(tmp.path()), Vec::<String>::new(), "{what}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 3 * 5, "only {checked} kills were checked");
}

#[test]
fn a_save_killed_between_the_two_renames_is_completed_by_the_next_save() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("weights");
    save("model", 1.0, &dir, 1 << 20);
    let spec = format!("{}|model|MovedAside|0|{}", dir.display(), 1 << 20);
    assert_eq!(run_child(&spec), KILLED);
    assert!(!dir.exists(), "the kill left the gap between the renames");
    // No load in between: the next save finds the gap itself.
    save("model", 3.0, &dir, 1 << 20);
    assert_eq!(load("model", &dir), 3.0);
    assert_eq!(hidden_leftovers(tmp.path()), Vec::<String>::new());
}
