//! torch programs under `accel launch`, against the same programs under
//! torchrun, with the real torch 2.13 (`make torch-venv`). Without it the
//! tests print why and skip; under CI they fail.

mod common;
use accel_test_support::free_port;
use accel_test_support::skips;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// The venv's bin folder (python3, torchrun, accelerate).
fn venv_bin() -> Option<PathBuf> {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.accel-cache/torch-venv/bin");
    if bin.join("torchrun").exists() {
        return Some(bin);
    }
    skips::skip(&format!(
        "no torch venv at {} (`make torch-venv`)",
        bin.display()
    ));
    None
}

/// The venv's bin folder and a fresh temporary directory, or `None` (the
/// test skips) without the venv.
fn venv_and_dir() -> Option<(PathBuf, tempfile::TempDir)> {
    Some((venv_bin()?, tempfile::tempdir().unwrap()))
}

/// [`venv_and_dir`], with the script `name` holding `text` in that
/// directory: its path is the third.
fn venv_with(name: &str, text: &str) -> Option<(PathBuf, tempfile::TempDir, String)> {
    let (bin, dir) = venv_and_dir()?;
    let path = script(dir.path(), name, text);
    Some((bin, dir, path))
}

/// `cmd` with the venv's python3 first on PATH (torchrun's "current Python").
fn in_venv(mut cmd: Command, bin: &Path) -> Command {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    cmd.env("PATH", std::env::join_paths(dirs).unwrap());
    cmd.env_remove("OMP_NUM_THREADS");
    cmd
}

fn script(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

const DDP: &str = r#"
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
r = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1234 + r)
for step in range(20):
    x = torch.randn(4, 8, generator=g)
    y = x.sum(1, keepdim=True)
    opt.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
# A file per rank: torchrun's ranks share one stdout, where unbuffered
# writes of two ranks interleave inside a line.
with open(f"{sys.argv[1]}/params-{r}.hex", "w") as f:
    f.write(flat.numpy().tobytes().hex())
# Both ranks done before either tears gloo down: a rank whose peer closed
# its pairs first can abort in gloo's threads ("terminate called without
# an active exception", seen under torchrun in CI).
dist.barrier()
dist.destroy_process_group()
# Skip interpreter finalization: gloo's threads can still hold tensors whose
# release needs the GIL there and abort the rank (pytorch/pytorch#179291).
sys.stdout.flush()
os._exit(0)
"#;

/// Runs `run` again, once, when torch's gloo aborted a rank in its C++
/// teardown (seen in CI under torchrun alone, so it is torch's, not the
/// launcher's); says so on stderr. Any other failure is returned as is.
fn twice_on_teardown_abort(run: impl Fn() -> Run) -> Run {
    let first = run();
    if first.code != Some(0)
        && first
            .stderr
            .contains("terminate called without an active exception")
    {
        eprintln!(
            "torch's gloo aborted a rank at teardown; running once more:\n{}",
            first.all()
        );
        return run();
    }
    first
}

fn params(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("params-{rank}.hex")))
        .unwrap_or_else(|e| panic!("no parameters of rank {rank} in {}: {e}", dir.display()))
}

#[test]
fn a_torch_ddp_script_ends_bit_for_bit_as_under_torchrun() {
    let Some((bin, dir, ddp)) = venv_with("ddp.py", DDP) else {
        return;
    };

    let (ours_dir, theirs_dir) = (dir.path().join("ours"), dir.path().join("theirs"));
    std::fs::create_dir_all(&ours_dir).unwrap();
    std::fs::create_dir_all(&theirs_dir).unwrap();
    let ours_arg = ours_dir.to_string_lossy().into_owned();
    let ours = twice_on_teardown_abort(|| {
        start(in_venv(
            command(&["launch", "-n", "2", &ddp, &ours_arg]),
            &bin,
        ))
        .finish(Duration::from_secs(120))
    });
    ours.code_is(0);
    let theirs = twice_on_teardown_abort(|| {
        let mut theirs = Command::new(bin.join("torchrun"));
        theirs
            .args(["--standalone", "--nproc-per-node", "2", &ddp])
            .arg(&theirs_dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        start(in_venv(theirs, &bin)).finish(Duration::from_secs(120))
    });
    theirs.code_is(0);
    let p = params(&ours_dir, 0);
    assert_eq!(p.len(), 2 * 4 * 161, "161 f32 parameters");
    assert_eq!(p, params(&ours_dir, 1), "DDP keeps the ranks equal");
    assert_eq!(
        p,
        params(&theirs_dir, 0),
        "accel launch and torchrun end on other parameters"
    );
    // No rank raised (the OMP_NUM_THREADS policy is checked in
    // module_and_no_python_run_as_under_torchrun).
    assert!(!ours.stderr.contains("Traceback"), "{}", ours.all());
}

const RAISE: &str = r#"
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up")
    dist.barrier()

main()
"#;

#[test]
fn a_raising_torch_rank_is_the_root_cause_with_its_python_exception() {
    let Some((bin, _dir, raise)) = venv_with("raise.py", RAISE) else {
        return;
    };
    let r = start(in_venv(command(&["launch", "-n", "2", &raise]), &bin))
        .finish(Duration::from_secs(120));
    assert_ne!(r.code, Some(0), "{}", r.all());
    let block = r
        .stderr
        .split("root cause")
        .nth(1)
        .unwrap_or_else(|| panic!("no root-cause block:\n{}", r.all()));
    assert!(block.contains("rank:      1"), "{block}");
    assert!(block.contains("ValueError: rank one gives up"), "{block}");
    assert!(block.contains("raise.py:9 (in main)"), "{block}");
}

/// A module for `python -m`: says its rank, whether torch's agent store is
/// used, and OMP_NUM_THREADS.
const HELLO_MOD: &str = "import os\nprint('hello from', os.environ['RANK'], os.environ['TORCHELASTIC_USE_AGENT_STORE'], os.environ.get('OMP_NUM_THREADS'))\n";

#[test]
fn module_and_no_python_run_as_under_torchrun() {
    let Some((bin, dir, _)) = venv_with("hello_mod.py", HELLO_MOD) else {
        return;
    };
    let mut cmd = in_venv(command(&["launch", "-n", "2", "-m", "hello_mod"]), &bin);
    cmd.current_dir(dir.path()).env("PYTHONPATH", dir.path());
    let r = start(cmd).finish(Duration::from_secs(60));
    r.code_is(0);
    for rank in 0..2 {
        assert!(
            rank_lines(&r.stdout, rank).contains(&format!("hello from {rank} True 1")),
            "{}",
            r.all()
        );
    }
    // --no-python runs a .py file as a program (here: not executable).
    let py = script(dir.path(), "plain.py", "print('x')\n");
    let r = accel(&["launch", "-n", "1", "--no-python", &py]);
    assert_ne!(r.code, Some(0), "{}", r.all());
}

#[test]
fn torchruns_flags_map_and_the_ones_that_do_not_are_refused_with_a_reason() {
    let r = accel(&[
        "launch",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "-n",
        "1",
        "--",
        "true",
    ]);
    assert!(r.stderr.contains("port is not in 1-65535"), "{}", r.all());
    let r = accel(&[
        "launch",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost",
        "--monitor-interval",
        "5",
        "-n",
        "2",
        "--",
        "true",
    ]);
    r.code_is(0);
    for (flag, why) in [
        ("--start-method", "fork and exec"),
        ("--local-ranks-filter", "--ranks"),
        ("--use-deepspeed", "--sharding"),
    ] {
        let r = accel(&["launch", "-n", "1", flag, "x", "--", "true"]);
        r.code_is(2);
        assert!(
            r.stderr.contains("has no counterpart") && r.stderr.contains(why),
            "{flag}: {}",
            r.all()
        );
        assert!(!r.stderr.contains("did you mean"), "{flag}: {}", r.all());
    }
}

// ---- Accelerate's config file and --gradient_accumulation_steps ----

/// Prints what Accelerate's `Accelerator()` took from its launcher.
const CONFIG_PROBE: &str = r#"
import os
from accelerate import Accelerator
acc = Accelerator()
# One write per line: under accelerate launch the ranks share one unbuffered
# stdout, where print's pieces of two ranks interleave.
line = f"CFG {str(acc.distributed_type)} {acc.num_processes} {acc.process_index} {acc.mixed_precision} {acc.gradient_accumulation_steps}\n"
os.write(1, line.encode())
acc.end_training()
"#;

/// The lines a run printed from `tag` on, rank prefixes removed, sorted.
fn tagged_lines(out: &str, tag: &str) -> Vec<String> {
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.find(tag).map(|i| l[i..].to_string()))
        .collect();
    v.sort();
    v
}

/// The `CFG ...` lines a run printed.
fn cfg_lines(out: &str) -> Vec<String> {
    tagged_lines(out, "CFG ")
}

/// A config file written by Accelerate's own writer (what `accelerate
/// config` saves after its questions).
fn accelerate_writes(bin: &Path, file: &Path, fields: &str) {
    let code = format!(
        "from accelerate.commands.config.config_args import ClusterConfig\n\
         ClusterConfig(compute_environment='LOCAL_MACHINE', use_cpu=False, debug=False, \
         {fields}).to_yaml_file({:?})\n",
        file.to_string_lossy()
    );
    let mut py = Command::new(bin.join("python3"));
    py.args(["-c", &code])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    start(py).finish(Duration::from_secs(60)).code_is(0);
}

#[test]
fn accelerates_config_file_launches_as_under_accelerate_launch() {
    let Some((bin, dir, probe)) = venv_with("probe.py", CONFIG_PROBE) else {
        return;
    };
    let cfg = dir.path().join("accel_config.yaml");
    accelerate_writes(
        &bin,
        &cfg,
        "distributed_type='MULTI_GPU', num_processes=2, mixed_precision='bf16'",
    );
    let yaml = std::fs::read_to_string(&cfg).unwrap();
    assert!(yaml.contains("distributed_type: MULTI_GPU"), "{yaml}");
    let cfg = cfg.to_string_lossy().into_owned();
    // --gradient_accumulation_steps reaches Accelerator() through
    // ACCELERATE_GRADIENT_ACCUMULATION_STEPS (accelerate launch sets it for
    // DeepSpeed only, so its processes keep 1).
    let ours = start(in_venv(
        command(&[
            "launch",
            "--config_file",
            &cfg,
            "--gradient_accumulation_steps",
            "3",
            &probe,
        ]),
        &bin,
    ))
    .finish(Duration::from_secs(120));
    ours.code_is(0);
    let mut theirs = Command::new(bin.join("accelerate"));
    theirs
        .args(["launch", "--config_file", &cfg, &probe])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let theirs = start(in_venv(theirs, &bin)).finish(Duration::from_secs(120));
    theirs.code_is(0);
    let (lines, their_lines) = (cfg_lines(&ours.stdout), cfg_lines(&theirs.stdout));
    // Two processes, each in bf16 (on a machine without GPUs Accelerate's
    // MULTI_GPU leaves each process on its own, under accelerate launch
    // too).
    assert_eq!(lines.len(), 2, "two processes: {}", ours.all());
    assert!(
        lines.iter().all(|l| l.ends_with(" bf16 3")),
        "{}",
        ours.all()
    );
    assert!(
        their_lines.iter().all(|l| l.ends_with(" bf16 1")),
        "{}",
        theirs.all()
    );
    let but_steps = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|l| l.rsplit_once(' ').unwrap().0.to_string())
            .collect()
    };
    assert_eq!(
        but_steps(&lines),
        but_steps(&their_lines),
        "{}\n{}",
        ours.all(),
        theirs.all()
    );
}

#[test]
fn accelerates_default_config_is_read_and_what_accel_cannot_honour_is_refused() {
    let Some((bin, dir)) = venv_and_dir() else {
        return;
    };
    // `accelerate config default` (JSON, whatever the file's name).
    let cfg = dir.path().join("default_config.yaml");
    let mut acc = Command::new(bin.join("accelerate"));
    acc.args(["config", "default", "--config_file"])
        .arg(&cfg)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    start(in_venv(acc, &bin))
        .finish(Duration::from_secs(60))
        .code_is(0);
    let cfg_s = cfg.to_string_lossy().into_owned();
    // distributed_type NO, use_cpu true: one cpu-gloo process.
    let r = accel(&[
        "launch",
        "--config_file",
        &cfg_s,
        "--",
        "sh",
        "-c",
        "echo ws=$WORLD_SIZE backend=$ACCEL_BACKEND cpu=$ACCELERATE_USE_CPU",
    ]);
    r.code_is(0);
    assert!(
        r.stdout.contains("ws=1 backend=cpu-gloo cpu=True"),
        "{}",
        r.all()
    );
    for (extra, says) in [
        (
            "distributed_type: DEEPSPEED\n",
            "`distributed_type: DEEPSPEED`",
        ),
        (
            "distributed_type: MULTI_GPU\ngpu_ids: '0,1'\n",
            "`gpu_ids: 0,1`",
        ),
        (
            "distributed_type: MULTI_GPU\nnum_procs: 2\n",
            "unknown key `num_procs`",
        ),
    ] {
        let f = dir.path().join("bad.yml");
        std::fs::write(&f, extra).unwrap();
        let r = accel(&[
            "launch",
            "--config-file",
            &f.to_string_lossy(),
            "--",
            "true",
        ]);
        r.code_is(2);
        r.has_stderr(says);
        r.has_stderr("bad.yml");
    }
}

// ---- torchrun's --tee / --redirects / --log-dir ----

/// Every file under `dir`'s one run directory, by its path below it
/// (`attempt_0/1/stderr.log`), with its text.
fn run_logs(dir: &Path) -> Vec<(String, String)> {
    let runs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1, "one run directory in {}", dir.display());
    let mut files = Vec::new();
    let mut todo = vec![runs[0].clone()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "log") {
                let rel = p
                    .strip_prefix(&runs[0])
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                files.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// `(local rank, line)` of the workers' lines a launcher showed, from
/// accel's `[rank N] ` and torchrun's `[defaultN]:` prefixes.
fn shown(out: &str) -> Vec<(usize, String)> {
    let mut v: Vec<(usize, String)> = out
        .lines()
        .filter_map(|l| {
            let (head, text) = l
                .strip_prefix("[rank ")
                .and_then(|r| r.split_once("] "))
                .or_else(|| l.strip_prefix("[default").and_then(|r| r.split_once("]:")))?;
            Some((head.parse().ok()?, text.to_string()))
        })
        .collect();
    v.sort();
    v
}

#[test]
fn torchruns_tee_and_redirects_write_and_show_what_torchrun_does() {
    let Some((bin, dir)) = venv_and_dir() else {
        return;
    };
    let (ours_dir, theirs_dir) = (dir.path().join("ours"), dir.path().join("theirs"));
    // Local rank 0: both streams teed; rank 1: stdout teed, stderr
    // redirected (to its file only).
    let flags = |log_dir: &Path| -> Vec<String> {
        [
            "--nproc-per-node",
            "2",
            "--tee",
            "0:3,1:1",
            "-r", // torchrun's short --redirects
            "1:2",
            "--log-dir",
            &log_dir.to_string_lossy(),
            "--no-python",
            "sh",
            "-c",
            "echo out $LOCAL_RANK; echo err $LOCAL_RANK >&2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let ours_args = flags(&ours_dir);
    let mut words = vec!["launch"];
    words.extend(ours_args.iter().map(String::as_str));
    let ours = start(command(&words)).finish(Duration::from_secs(60));
    ours.code_is(0);
    let mut theirs = Command::new(bin.join("torchrun"));
    theirs
        .arg("--standalone")
        .args(flags(&theirs_dir))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let theirs = start(in_venv(theirs, &bin)).finish(Duration::from_secs(120));
    theirs.code_is(0);
    let logs = run_logs(&ours_dir);
    assert_eq!(logs.len(), 4, "{logs:?}");
    assert_eq!(logs, run_logs(&theirs_dir));
    let both = |r: &common::Run| {
        let mut v = shown(&r.stdout);
        v.extend(shown(&r.stderr));
        v.sort();
        v
    };
    assert_eq!(
        both(&ours),
        vec![
            (0, "err 0".to_string()),
            (0, "out 0".to_string()),
            (1, "out 1".to_string())
        ],
        "{}",
        ours.all()
    );
    assert_eq!(
        both(&ours),
        both(&theirs),
        "{}\n{}",
        ours.all(),
        theirs.all()
    );
}

// ---- torch programs under accel launch over several machines ----

const ALL_REDUCE: &str = r#"
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
# A file per rank: PYTHONUNBUFFERED writes of ranks interleave on stdout.
with open(f"{sys.argv[1]}/rank-{r}.txt", "w") as f:
    f.write(f"{w} {t.item():g} {os.environ['LOCAL_RANK']} {os.environ['GROUP_RANK']} {attempt}")
dist.barrier()
dist.destroy_process_group()
# The first attempt fails on machine 1: the second must meet on a fresh
# torch store (torch expects one per attempt).
if attempt == "0" and r == 3:
    sys.exit(3)
"#;

#[test]
fn a_torch_program_runs_under_accel_launch_on_two_machines() {
    let port = free_port().to_string();
    torch_on_two_machines(&|rank| {
        let mut args = machine_args("2", rank, "127.0.0.1", &port);
        args.push("--join-timeout");
        args.into_iter().map(String::from).collect()
    });
}

/// The same on an etcd cluster (`--rdzv-backend etcd`): the torch store is
/// hosted by the round's leader.
#[test]
fn a_torch_program_runs_under_accel_launch_on_two_machines_on_etcd() {
    let Some(c) = accel_test_support::etcd::EtcdCluster::start(3) else {
        return;
    };
    let eps = c.endpoint_list();
    torch_on_two_machines(&|_| {
        let line = "launch --nnodes 2 --rdzv-backend etcd --rdzv-id torch --rdzv-endpoint";
        let mut args = argv(line, &[&eps]);
        args.push("--join-timeout");
        args.into_iter().map(String::from).collect()
    });
}

/// ALL_REDUCE on 2 machines × 2 ranks, machine `K`'s launcher given by
/// `rendezvous(K)` (its arguments up to `--join-timeout`); the first
/// attempt fails on rank 3, the second must succeed on a fresh torch store.
fn torch_on_two_machines(rendezvous: &dyn Fn(&str) -> Vec<String>) {
    let Some((bin, dir, prog)) = venv_with("allreduce.py", ALL_REDUCE) else {
        return;
    };
    let out = dir.path().to_string_lossy().into_owned();
    let machine = |rank: &str| {
        let head = rendezvous(rank);
        let mut args: Vec<&str> = head.iter().map(String::as_str).collect();
        args.extend(argv(
            "60s --max-restarts 1 -n 2",
            &[prog.as_str(), out.as_str()],
        ));
        let mut c = in_venv(command(&args), &bin);
        c.env("ACCEL_RUN_TOKEN", "torch-machines");
        start(c)
    };
    let (m0, m1) = (machine("0"), machine("1"));
    let (r0, r1) = (
        m0.finish(Duration::from_secs(120)),
        m1.finish(Duration::from_secs(120)),
    );
    r0.code_is(0);
    r1.code_is(0);
    for rank in 0..4 {
        let got = std::fs::read_to_string(dir.path().join(format!("rank-{rank}.txt")))
            .unwrap_or_else(|e| {
                panic!(
                    "rank {rank} wrote nothing ({e}):\n{}\n{}",
                    r0.all(),
                    r1.all()
                )
            });
        // World size 4; 1+2+3+4; local rank; machine; the second attempt.
        assert_eq!(
            got,
            format!("4 10 {} {} 1", rank % 2, rank / 2),
            "rank {rank}"
        );
    }
}

const ACCELERATE: &str = r#"
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
acc = Accelerator(gradient_accumulation_steps=2)
set_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(
    torch.arange(40, dtype=torch.float32).reshape(10, 4) / 40,
    torch.arange(10, dtype=torch.float32).reshape(10, 1) / 10)
dl = torch.utils.data.DataLoader(data, batch_size=2)
model, opt, dl = acc.prepare(model, opt, dl)
for x, y in dl:
    with acc.accumulate(model):
        loss = ((model(x) - y) ** 2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
preds = acc.gather_for_metrics(model(torch.ones(3, 4)).detach())
w = acc.unwrap_model(model).weight.detach().flatten().tolist()
acc.print("ACC", acc.distributed_type, acc.num_processes, [round(v, 6) for v in preds.flatten().tolist()], [round(v, 6) for v in w])
# Without it, gloo's threads can abort the interpreter's exit
# ("terminate called without an active exception").
acc.wait_for_everyone()
acc.end_training()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
"#;

/// The `ACC ...` lines a run printed, rank prefixes removed, sorted.
fn acc_lines(out: &str) -> Vec<String> {
    tagged_lines(out, "ACC ")
}

#[test]
fn an_accelerate_script_prints_what_it_prints_under_accelerate_launch() {
    let Some((bin, _dir, s)) = venv_with("acc.py", ACCELERATE) else {
        return;
    };
    let ours =
        start(in_venv(command(&["launch", "-n", "2", &s]), &bin)).finish(Duration::from_secs(120));
    ours.code_is(0);
    let mut theirs = Command::new(bin.join("accelerate"));
    theirs
        .args(["launch", "--multi_gpu", "--num_processes", "2", &s])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let theirs = start(in_venv(theirs, &bin)).finish(Duration::from_secs(120));
    theirs.code_is(0);
    assert!(!acc_lines(&ours.stdout).is_empty(), "{}", ours.all());
    assert_eq!(
        acc_lines(&ours.stdout),
        acc_lines(&theirs.stdout),
        "{}\n{}",
        ours.all(),
        theirs.all()
    );
    // Accelerate's own multi-process CPU mode meets through accel's torch
    // endpoint: one process group of 2, the gathered metrics of both.
    let mut cmd = in_venv(command(&["launch", "-n", "2", &s]), &bin);
    cmd.env("ACCELERATE_USE_CPU", "1");
    let multi = start(cmd).finish(Duration::from_secs(120));
    multi.code_is(0);
    let l = acc_lines(&multi.stdout);
    assert_eq!(l.len(), 1, "only the main process prints: {}", multi.all());
    assert!(
        l[0].starts_with("ACC DistributedType.MULTI_CPU 2 ["),
        "{}",
        l[0]
    );
    let preds = l[0].split('[').nth(1).unwrap().split(']').next().unwrap();
    assert_eq!(preds.split(',').count(), 6, "{}", l[0]);
}

// ---- torchrun across two network-namespace machines (cluster) ----

/// `torchrun --nnodes 2 --rdzv-backend c10d` in two network namespaces
/// (machines 10.231.7.1 and .2), two accel ranks each: torchrun's c10d
/// rendezvous on machine 0, the ranks on the agent store, a cpu-gloo
/// all-reduce over 4 ranks. The namespaces share this box's host name,
/// which resolves to 127.0.0.1, so each agent is told its address
/// (`--local-addr`) and machine 0 that it hosts the rendezvous
/// (`--rdzv-conf is_host=true`), as on machines whose host name does not
/// resolve to their interface.
#[test]
fn accel_ranks_under_torchrun_across_two_namespace_machines() {
    use common::netns::Cluster;
    let t0 = std::time::Instant::now();
    let name = "accel_ranks_under_torchrun_across_two_namespace_machines";
    let Some(bin) = venv_bin() else { return };
    let Some(c) = Cluster::or_skip(2, name) else {
        return;
    };
    let torchrun = bin.join("torchrun");
    let endpoint = format!("{}:29400", c.addr(0));
    let node = |i: usize| {
        let host = if i == 0 { "true" } else { "false" };
        let conf = format!("is_host={host},join_timeout=60");
        let rank = i.to_string();
        let cmd = c.command(
            i,
            torchrun.to_str().expect("utf-8 path"),
            &[
                "--nnodes",
                "2",
                "--node-rank",
                &rank,
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                &endpoint,
                "--rdzv-id",
                "cluster",
                "--local-addr",
                c.addr(i),
                "--rdzv-conf",
                &conf,
                "--nproc-per-node",
                "2",
                "--no-python",
                ACCEL,
                "probe-worker",
                "--accelerator",
            ],
        );
        let mut cmd = in_venv(cmd, &bin);
        cmd.env_remove("ACCEL_RUN_TOKEN")
            .env_remove("ACCEL_BACKEND")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        start(cmd)
    };
    let (m0, m1) = (node(0), node(1));
    let runs = [
        m0.finish(Duration::from_secs(150)),
        m1.finish(Duration::from_secs(150)),
    ];
    let mut seen: Vec<serde_json::Value> = Vec::new();
    for r in &runs {
        r.code_is(0);
        seen.extend(
            r.stdout
                .lines()
                .filter_map(|l| l.find('{').map(|i| &l[i..]))
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()),
        );
    }
    let mut ranks: Vec<u64> = seen.iter().filter_map(|v| v["rank"].as_u64()).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2, 3], "{}\n{}", runs[0].all(), runs[1].all());
    for v in &seen {
        assert_eq!(v["world_size"], 4, "{v}");
        assert_eq!(v["backend"], "cpu-gloo", "{v}");
        // 1 + 2 + 3 + 4 over both machines.
        assert_eq!(v["all_reduce_sum"], 10.0, "{v}");
        assert!(
            v["store"]
                .as_str()
                .unwrap_or("")
                .starts_with("torch://10.231.7."),
            "{v}"
        );
    }
    for node_rank in [0, 1] {
        let n = seen.iter().filter(|v| v["node_rank"] == node_rank).count();
        assert_eq!(n, 2, "two ranks on node {node_rank}");
    }
    eprintln!("{name}: {:.1}s", t0.elapsed().as_secs_f64());
}
