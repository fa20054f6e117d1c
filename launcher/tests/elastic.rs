//! Elastic membership (`--nnodes MIN:MAX`, docs/adr/0026-elastic-membership.md):
//! several launchers on 127.0.0.1, one rank each, running `accel
//! elastic-worker` (a real training run on cpu-gloo that checkpoints and
//! logs the samples of every step); and on an etcd cluster of 3 loopback
//! members (`--rdzv-backend etcd`, module `training::on_etcd`), where any
//! machine may die, machine 0 included. Every launcher runs under a hard
//! limit.

mod common;

use accel_test_support::free_port;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

/// Hard limit of one elastic launcher.
const ELASTIC_LIMIT: Duration = Duration::from_secs(120);
/// Samples, batch per rank (4) and epochs of the worker: 96 divides by the
/// global batch at 3 ranks (12) and at 2 (8), and the tests checkpoint
/// every 24 samples (2 steps at 3 ranks, 3 at 2), which leaves a multiple
/// of both: no step at the end of an epoch is topped up.
const LEN: usize = 96;
const EPOCHS: u64 = 2;

fn machine(
    rank: usize,
    port: u16,
    nnodes: &str,
    dir: &Path,
    extra: &[&str],
    worker: &[&str],
) -> Command {
    let rdzv = [
        "--node-rank".to_string(),
        rank.to_string(),
        "--master-addr".into(),
        "127.0.0.1".into(),
        "--master-port".into(),
        port.to_string(),
        "--token".into(),
        "elastic".into(),
    ];
    launcher(&rdzv, nnodes, dir, extra, worker)
}

/// A launcher of the elastic worker, its rendezvous given by `rdzv`.
fn launcher(rdzv: &[String], nnodes: &str, dir: &Path, extra: &[&str], worker: &[&str]) -> Command {
    let args = launcher_args(rdzv, nnodes, dir, extra, worker);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    command(&refs)
}

/// The arguments of [`launcher`]'s `accel`.
fn launcher_args(
    rdzv: &[String],
    nnodes: &str,
    dir: &Path,
    extra: &[&str],
    worker: &[&str],
) -> Vec<String> {
    let ck = dir.join("ck");
    let log = dir.join("log");
    let mut args = vec!["launch".to_string(), "--nnodes".into(), nnodes.into()];
    args.extend(rdzv.iter().cloned());
    args.extend([
        "--backend".into(),
        "cpu-gloo".into(),
        "--timeout".into(),
        "20s".into(),
        "--grace-period".into(),
        "2s".into(),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(
        [
            "--",
            ACCEL,
            "elastic-worker",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--sample-log",
            log.to_str().unwrap(),
            "--train-len",
            &LEN.to_string(),
            "--epochs",
            &EPOCHS.to_string(),
        ]
        .map(String::from),
    );
    args.extend(worker.iter().map(|s| s.to_string()));
    args
}

/// No process of this test's run is left (the killed launcher's worker
/// included): their command lines name the test's folder.
#[track_caller]
fn no_worker_left(dir: &Path) {
    let marker = dir.to_string_lossy().into_owned();
    assert!(
        eventually(Duration::from_secs(5), || processes_with(&marker) == 0),
        "{} process(es) of the run left",
        processes_with(&marker)
    );
}

/// What machine `i` (of `runs`) printed, for assertion messages.
fn context(runs: &[&Run]) -> String {
    let all: Vec<String> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| format!("machine {i}:\n{}", r.all()))
        .collect();
    all.join("\n")
}

/// `text` contains each of `wants` (showing `context` if not).
#[track_caller]
fn says_each(text: &str, wants: &[&str], context: &str) {
    for w in wants {
        assert!(text.contains(w), "no {w:?}\n{context}");
    }
}

#[test]
fn fewer_than_min_machines_is_an_error_naming_who_is_in() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let r = start(machine(
        0,
        port,
        "2:3",
        dir.path(),
        &["--join-timeout", "2s"],
        &[],
    ))
    .finish(Duration::from_secs(30));
    assert_ne!(r.code, Some(0), "{}", r.all());
    r.has_stderr("1 machine(s) joined within 2s, fewer than the minimum of 2 (--num-machines 2:3)");
    r.has_stderr("in: ");
}

#[test]
fn elastic_ranges_are_checked() {
    refused_words(
        "launch --nnodes 3:2 --master-addr 127.0.0.1 --token t -- true",
        "MIN <= MAX",
    );
    refused_words(
        "launch --nnodes 2:3 --num-processes 4 --master-addr 127.0.0.1 --token t -- true",
        "elastic run",
    );
    refused_words(
        "launch --nnodes 1:2 --backend mpi --master-addr 127.0.0.1 --token t -- true",
        "mpirun's world is fixed",
    );
}

#[test]
fn etcd_rendezvous_flags_are_checked_before_anything_starts() {
    let e = "launch --rdzv-backend etcd";
    refused_words(
        &format!("{e} --nnodes 2 --rdzv-endpoint 127.0.0.1:2379 -- true"),
        "needs a run id",
    );
    refused_words(
        &format!("{e} --nnodes 2 --rdzv-id r -- true"),
        "needs the cluster's members",
    );
    refused_words(
        &format!("{e} --nnodes 1 --rdzv-id r --rdzv-endpoint h:2379 -- true"),
        "coordinates several machines",
    );
    refused_words(
        &format!("{e} --nnodes 2 --rdzv-id r --rdzv-endpoint h:0 -- true"),
        "1-65535",
    );
    refused_words(
        &format!("{e} --nnodes 2 --rdzv-id r --rdzv-endpoint h:1 --rdzv-conf color=red -- true"),
        "takes cacert, cert, key, user and password_file",
    );
    refused_words(
        &format!("{e} --nnodes 2 --rdzv-id r --rdzv-endpoint h:1 --rdzv-conf user=u -- true"),
        "needs both user=NAME and password_file=FILE",
    );
    refused_words(
        &format!("{e} --nnodes 2 --rdzv-id r --rdzv-endpoint h:1 --rdzv-conf cert=c.pem -- true"),
        "needs its key",
    );
    refused_words(
        &format!("{e} --nnodes 2 --rdzv-id r --rdzv-endpoint h:1 --backend mpi -- true"),
        "one mpirun",
    );
    refused_words(
        "launch --nnodes 2 --rdzv-conf user=u --master-addr 127.0.0.1 --token t -- true",
        "pass --rdzv-backend etcd",
    );
    // torch's other name runs the same rendezvous, and says so.
    let r = start(command(&argv(
        "launch --rdzv-backend etcd-v2 --nnodes 2 --rdzv-id r --join-timeout 1s --rdzv-endpoint",
        &["127.0.0.1:1", "--", "true"],
    )))
    .finish(Duration::from_secs(30));
    r.has_stderr("accel's etcd rendezvous runs, over etcd's v3 API");
    // Nobody answers there: the join's bound, naming the endpoint.
    let port = free_port().to_string();
    let r = start(command(&argv(
        "launch --rdzv-backend etcd --nnodes 2 --rdzv-id r --join-timeout 1s --rdzv-endpoint",
        &[&format!("127.0.0.1:{port}"), "--", "true"],
    )))
    .finish(Duration::from_secs(30));
    assert_eq!(r.code, Some(1), "{}", r.all());
    r.has_stderr("no quorum of the etcd cluster");
    r.has_stderr(&port);
}

#[test]
fn a_machine_frozen_after_its_workers_ended_is_left_behind_within_the_timeout() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "touch {d}/started-$RANK-$ACCEL_RESTART_COUNT; \
         if [ $RANK = 2 ]; then sleep 1; exit 0; fi; \
         sleep 3; echo done $ACCEL_RESTART_COUNT $WORLD_SIZE",
        d = dir.path().display()
    );
    let launcher = |rank: usize| {
        command(&argv(
            "launch --nnodes 2:3 --master-addr 127.0.0.1 --token t --timeout 3s \
             --join-window 2s --join-timeout 30s --max-restarts 1 --node-rank",
            &[
                &rank.to_string(),
                "--master-port",
                &port.to_string(),
                "--",
                "sh",
                "-c",
                &script,
            ],
        ))
    };
    let m0 = start(launcher(0));
    let m1 = start(launcher(1));
    let mut m2 = start(launcher(2));
    // Machine 2's launcher freezes (SIGSTOP) while its worker runs: the
    // worker ends, and the launcher never reports it.
    assert!(
        eventually(Duration::from_secs(30), || dir
            .path()
            .join("started-2-0")
            .exists()),
        "machine 2's worker did not start"
    );
    let stopped = Command::new("kill")
        .args(["-STOP", &m2.pid().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let r0 = m0.finish(ELASTIC_LIMIT);
    let r1 = m1.finish(ELASTIC_LIMIT);
    m2.child.kill().unwrap();
    let _ = m2.child.wait();
    let context = context(&[&r0, &r1]);
    for r in [&r0, &r1] {
        assert_eq!(r.code, Some(0), "{context}");
        // Named by its silent heartbeat (timeout + 2 s), or, should the
        // others' workers end first, as the machine that did not report
        // its workers' end within the timeout.
        assert!(
            r.stderr.contains("machine 2 (")
                && (r.stderr.contains("did not report the end of its workers")
                    || r.stderr.contains("its launcher sent no heartbeat")),
            "{context}"
        );
    }
    says_each(
        &r0.stderr,
        &["round 1: 2 machine(s), world size 2"],
        &context,
    );
    assert_eq!(
        rank_lines(&r0.stdout, 0),
        ["done 0 3", "done 1 2"],
        "{context}"
    );
    assert_eq!(
        rank_lines(&r1.stdout, 1),
        ["done 0 3", "done 1 2"],
        "{context}"
    );
    no_worker_left(dir.path());
}

/// The runs that train (on cpu-gloo).
#[cfg(feature = "cpu-gloo")]
mod training {
    use super::*;
    use std::collections::BTreeMap;

    /// The committed steps of every attempt, from the sample logs: attempt `a`
    /// counts up to the step attempt `a + 1` resumed after. Returns how often
    /// each `(epoch, sample)` was trained on, and each attempt's ranks.
    fn committed(log: &Path) -> (BTreeMap<(u64, usize), usize>, BTreeMap<u32, usize>) {
        let mut resumed: BTreeMap<u32, u64> = BTreeMap::new();
        let mut files: Vec<(u32, std::path::PathBuf)> = Vec::new();
        for e in std::fs::read_dir(log).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if let Some(a) = name.strip_suffix(".resumed") {
                let a: u32 = a[1..].parse().unwrap();
                resumed.insert(
                    a,
                    std::fs::read_to_string(&p).unwrap().trim().parse().unwrap(),
                );
            } else if let Some((a, _)) = name.split_once("-rank") {
                files.push((a[1..].parse().unwrap(), p));
            }
        }
        let mut ranks: BTreeMap<u32, usize> = BTreeMap::new();
        let mut seen: BTreeMap<(u64, usize), usize> = BTreeMap::new();
        for (a, p) in files {
            *ranks.entry(a).or_default() += 1;
            let upto = resumed.range(a + 1..).next().map_or(u64::MAX, |(_, s)| *s);
            for line in std::fs::read_to_string(&p).unwrap().lines() {
                let w: Vec<&str> = line.split_whitespace().collect();
                let (step, epoch): (u64, u64) = (w[1].parse().unwrap(), w[3].parse().unwrap());
                if step > upto {
                    continue;
                }
                for i in w[4].split(',') {
                    *seen.entry((epoch, i.parse().unwrap())).or_default() += 1;
                }
            }
        }
        (seen, ranks)
    }

    #[track_caller]
    fn every_sample_once(log: &Path, context: &str) {
        let (seen, _) = committed(log);
        for epoch in 0..EPOCHS {
            for i in 0..LEN {
                let n = seen.get(&(epoch, i)).copied().unwrap_or(0);
                assert_eq!(
                    n, 1,
                    "sample {i} of epoch {epoch} trained on {n} times\n{context}"
                );
            }
        }
    }

    /// A training run over `nn` machines: its folder (checkpoints, and
    /// the sample logs in `log`), its store's port, and its launchers'
    /// settings: up to 2 restarts, machines joining within `join[0]`, a
    /// round closing `join[1]` after the minimum arrived; the worker waits
    /// `pace[0]` ms a step and saves every `pace[1]` steps.
    struct Training {
        dir: tempfile::TempDir,
        log: std::path::PathBuf,
        port: u16,
        nn: &'static str,
        join: [&'static str; 2],
        pace: [&'static str; 2],
    }

    impl Training {
        fn new(nn: &'static str, join: [&'static str; 2], pace: [&'static str; 2]) -> Training {
            let dir = tempfile::tempdir().unwrap();
            let log = dir.path().join("log");
            let port = free_port();
            Training {
                dir,
                log,
                port,
                nn,
                join,
                pace,
            }
        }

        /// Start machine `rank`'s launcher.
        fn start(&self, rank: usize) -> Running {
            start(self.machine(rank))
        }

        /// The launcher of machine `rank`.
        fn machine(&self, rank: usize) -> Command {
            let extra = [
                "--max-restarts",
                "2",
                "--join-timeout",
                self.join[0],
                "--join-window",
                self.join[1],
            ];
            let worker = [
                "--step-delay-ms",
                self.pace[0],
                "--save-every",
                self.pace[1],
            ];
            machine(rank, self.port, self.nn, self.dir.path(), &extra, &worker)
        }
    }

    /// Wait until the run's sample log has step `step` on some rank of
    /// attempt 0.
    fn reached(log: &Path, step: u64) -> bool {
        std::fs::read_to_string(log.join("a0-rank0.log"))
            .map(|t| t.lines().count() as u64 >= step)
            .unwrap_or(false)
    }

    #[test]
    fn three_machines_lose_one_and_finish_on_two_with_every_sample_once() {
        // Up to 4: round 0 closes with the 3 after the join window (5 s from
        // the second machine's arrival: time enough for the third to start).
        let t = Training::new("2:4", ["30s", "5s"], ["150", "2"]);
        let (dir, log) = (&t.dir, &t.log);
        let (m0, m1, mut m2) = (t.start(0), t.start(1), t.start(2));
        // Kill machine 2's launcher (SIGKILL) after step 5 of 16: its worker
        // dies with it; the last checkpoint is at step 4.
        assert!(
            eventually(Duration::from_secs(60), || reached(log, 5)),
            "the run did not reach step 5"
        );
        m2.child.kill().unwrap();
        let _ = m2.child.wait();
        let r0 = m0.finish(ELASTIC_LIMIT);
        let r1 = m1.finish(ELASTIC_LIMIT);
        let context = context(&[&r0, &r1]);
        assert_eq!(r0.code, Some(0), "{context}");
        assert_eq!(r1.code, Some(0), "{context}");
        let rounds = [
            "round 0: 3 machine(s), world size 3",
            "round 1: 2 machine(s), world size 2",
        ];
        says_each(&r0.stderr, &rounds, &context);
        let resumed = rank_lines(&r0.stdout, 0)
            .into_iter()
            .find(|l| l.starts_with("resumed from"))
            .unwrap_or_default();
        assert!(
            resumed.contains("at world size 2: epoch 0"),
            "{resumed}\n{context}"
        );
        let (_, ranks) = committed(log);
        resumed_inside_epoch_0(log, 8, &context);
        assert_eq!(ranks.get(&0), Some(&3), "{context}");
        assert_eq!(ranks.get(&1), Some(&2), "{context}");
        every_sample_once(log, &context);
        assert!(
            r0.stdout.contains("final: ") && r0.stdout.contains("world size 2"),
            "{context}"
        );
        no_worker_left(dir.path());
    }

    /// Attempt 1 resumed from a checkpoint inside epoch 0 (of `steps` steps at
    /// attempt 0's world size), so that the every-sample-once check covers a
    /// resharded position.
    #[track_caller]
    fn resumed_inside_epoch_0(log: &Path, steps: u64, context: &str) {
        let at: u64 = std::fs::read_to_string(log.join("a1.resumed"))
            .unwrap_or_default()
            .trim()
            .parse()
            .unwrap_or(0);
        assert!(
            at > 0 && at < steps,
            "attempt 1 resumed after step {at}, not inside epoch 0\n{context}"
        );
    }

    #[test]
    fn a_machine_that_joins_later_grows_the_world_at_the_next_restart() {
        let t = Training::new("2:3", ["60s", "2s"], ["300", "3"]);
        let (dir, log) = (&t.dir, &t.log);
        let (m0, m1) = (t.start(0), t.start(1));
        assert!(
            eventually(Duration::from_secs(60), || reached(log, 1)),
            "the run did not start on 2 machines"
        );
        // The third machine arrives while round 0 runs: it waits (its stderr
        // goes to a file, to see when).
        let m2_err = dir.path().join("m2.err");
        let mut cmd = t.machine(2);
        cmd.stderr(std::fs::File::create(&m2_err).unwrap());
        let m2 = start(cmd);
        let waiting = || {
            std::fs::read_to_string(&m2_err)
                .unwrap_or_default()
                .contains("waits for the next round")
        };
        assert!(
            eventually(Duration::from_secs(60), waiting),
            "machine 2 does not wait for the next round: {}",
            std::fs::read_to_string(&m2_err).unwrap_or_default()
        );
        // After the checkpoint of step 3 (of 12 in epoch 0), a worker of
        // machine 1 fails (killed): the run restarts, with 3.
        assert!(
            eventually(Duration::from_secs(60), || reached(log, 4)),
            "the run did not reach step 4"
        );
        let worker = children(m1.pid());
        assert!(!worker.is_empty(), "machine 1 has no worker");
        for w in worker {
            let _ = Command::new("kill").args(["-9", &w.to_string()]).status();
        }
        let r0 = m0.finish(ELASTIC_LIMIT);
        let r1 = m1.finish(ELASTIC_LIMIT);
        let r2 = m2.finish(ELASTIC_LIMIT);
        let context = format!(
            "{}{}",
            context(&[&r0, &r1, &r2]),
            std::fs::read_to_string(&m2_err).unwrap_or_default()
        );
        for r in [&r0, &r1, &r2] {
            assert_eq!(r.code, Some(0), "{context}");
        }
        let rounds = [
            "round 0: 2 machine(s), world size 2",
            "round 1: 3 machine(s), world size 3",
        ];
        says_each(&r0.stderr, &rounds, &context);
        let (_, ranks) = committed(log);
        assert_eq!(ranks.get(&0), Some(&2), "{context}");
        assert_eq!(ranks.get(&1), Some(&3), "{context}");
        resumed_inside_epoch_0(log, 12, &context);
        every_sample_once(log, &context);
        no_worker_left(dir.path());
    }

    /// The rendezvous on a 3-member etcd cluster (`--rdzv-backend etcd`):
    /// no machine hosts the store, each round elects its machine 0.
    mod on_etcd {
        use super::*;
        use accel_test_support::etcd::{EtcdCluster, Host};
        use common::netns::Cluster;

        /// Launcher `k` of run `run` (2 ranks, `--nnodes 2:3`); its
        /// stderr goes to `m{k}.err` in `dir`, to see who leads a round.
        fn etcd_machine(c: &EtcdCluster, run: &str, dir: &Path, k: usize) -> Command {
            etcd_machine_on(None, c, (run, "300"), dir, k)
        }

        /// [`etcd_machine`], on machine `k` of `net` when given, the
        /// worker waiting `delay` ms a step.
        fn etcd_machine_on(
            net: Option<&Cluster>,
            c: &EtcdCluster,
            (run, delay): (&str, &str),
            dir: &Path,
            k: usize,
        ) -> Command {
            let rdzv = [
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &c.endpoint_list(),
                "--rdzv-id",
                run,
                "-n",
                "2",
            ]
            .map(String::from);
            let extra = [
                "--max-restarts",
                "2",
                "--join-timeout",
                "60s",
                "--join-window",
                "5s",
            ];
            // A checkpoint every 2 steps at world size 6 (48 samples): a
            // multiple of the global batch at 4 (16), so no step at the end
            // of an epoch is topped up after the resume.
            let worker = ["--step-delay-ms", delay, "--save-every", "2"];
            let mut cmd = match net {
                None => launcher(&rdzv, "2:3", dir, &extra, &worker),
                Some(net) => {
                    let args = launcher_args(&rdzv, "2:3", dir, &extra, &worker);
                    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
                    let mut cmd = net.command(k, ACCEL, &refs);
                    clean(&mut cmd);
                    cmd
                }
            };
            cmd.stderr(std::fs::File::create(dir.join(format!("m{k}.err"))).unwrap());
            cmd
        }

        fn err(dir: &Path, k: usize) -> String {
            std::fs::read_to_string(dir.join(format!("m{k}.err"))).unwrap_or_default()
        }

        /// The stderr of launchers `0..n`, one after another.
        fn errs(dir: &Path, n: usize) -> String {
            (0..n).map(|k| err(dir, k)).collect::<Vec<_>>().join("\n")
        }

        /// Waits (90 s at most) for the run of `n` launchers in `dir` to
        /// log step 3: a checkpoint (step 2) is out.
        #[track_caller]
        fn past_step_3(dir: &Path, n: usize) {
            assert!(
                eventually(Duration::from_secs(90), || reached(&dir.join("log"), 3)),
                "the run did not reach step 3\n{}",
                errs(dir, n)
            );
        }

        /// The launcher (of 3) that led round 0.
        fn leader_of_round_0(dir: &Path) -> usize {
            (0..3)
                .find(|k| err(dir, *k).contains("round 0: 3 machine(s), world size 6"))
                .unwrap_or_else(|| panic!("no machine led round 0\n{}", errs(dir, 3)))
        }

        /// The launchers left after round 0's leader went: each succeeded,
        /// round 1 ran at world size 4, every sample of the run's sample log
        /// trained on once. The ranks of each attempt.
        #[track_caller]
        fn the_others_finished_at_world_size_4(
            runs: &[Run],
            dir: &Path,
            context: &str,
        ) -> std::collections::BTreeMap<u32, usize> {
            for r in runs {
                assert_eq!(r.code, Some(0), "{context}");
            }
            let all: Vec<String> = (0..3).map(|k| err(dir, k)).collect();
            assert!(
                all.concat().contains("round 1: 2 machine(s), world size 4"),
                "{context}"
            );
            let log = dir.join("log");
            every_sample_once(&log, context);
            let (_, ranks) = committed(&log);
            assert_eq!(ranks.get(&1), Some(&4), "{context}");
            ranks
        }

        #[test]
        fn machine_0_and_an_etcd_member_killed_the_two_others_finish_at_world_size_4_with_every_sample_once(
        ) {
            let Some(mut c) = EtcdCluster::start(3) else {
                return;
            };
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path();
            let mut ms: Vec<Option<Running>> = (0..3)
                .map(|k| Some(start(etcd_machine(&c, "kill-0", d, k))))
                .collect();
            // 6 ranks, 4 steps an epoch: after step 3 (the checkpoint of
            // step 2 is out), one etcd member dies (a quorum is left), then
            // round 0's machine 0.
            past_step_3(d, 3);
            let all = || errs(d, 3);
            c.kill(2);
            let leader = leader_of_round_0(d);
            let mut m0 = ms[leader].take().unwrap();
            m0.child.kill().unwrap();
            let _ = m0.child.wait();
            let runs: Vec<Run> = ms
                .into_iter()
                .flatten()
                .map(|m| m.finish(ELASTIC_LIMIT))
                .collect();
            let context = format!("{}\n{}", context(&runs.iter().collect::<Vec<_>>()), all());
            let ranks = the_others_finished_at_world_size_4(&runs, d, &context);
            assert_eq!(ranks.get(&0), Some(&6), "{context}");
            no_worker_left(d);
            // The run's id is spent: a launcher reusing it is told so.
            let r = start(etcd_machine(&c, "kill-0", d, 9)).finish(Duration::from_secs(30));
            assert_ne!(r.code, Some(0));
            let e = err(d, 9);
            assert!(
                e.contains("run `kill-0` already ended") && e.contains("--rdzv-id"),
                "{e}"
            );
        }

        #[test]
        fn machine_0_cut_off_ends_naming_the_lost_cluster_and_the_others_finish_with_every_sample_once(
        ) {
            // Machines 0-2 run the launchers, 3-5 the etcd members, each a
            // network namespace on one bridge.
            let Some(net) = Cluster::or_skip(6, "etcd: machine 0 cut off") else {
                return;
            };
            let hosts = (3..6)
                .map(|i| Host {
                    addr: net.addr(i).to_string(),
                    prefix: ["ip", "netns", "exec", &net.machines[i].ns]
                        .map(String::from)
                        .to_vec(),
                })
                .collect();
            let Some(c) = EtcdCluster::start_on(hosts) else {
                return;
            };
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path();
            let mut ms: Vec<Option<Running>> = (0..3)
                .map(|k| {
                    Some(start(etcd_machine_on(
                        Some(&net),
                        &c,
                        ("cut-0", "300"),
                        d,
                        k,
                    )))
                })
                .collect();
            past_step_3(d, 3);
            let all = || errs(d, 3);
            let leader = leader_of_round_0(d);
            net.cut(leader);
            let cut_at = std::time::Instant::now();
            let cut = ms[leader].take().unwrap().finish(ELASTIC_LIMIT);
            let took = cut_at.elapsed();
            let runs: Vec<Run> = ms
                .into_iter()
                .flatten()
                .map(|m| m.finish(ELASTIC_LIMIT))
                .collect();
            let context = format!("{}\n{}", context(&runs.iter().collect::<Vec<_>>()), all());
            // The cut machine: it lost the cluster, within 2 x (timeout + 2 s).
            assert_ne!(cut.code, Some(0), "{context}");
            assert!(
                err(d, leader).contains("lost the etcd cluster"),
                "{context}"
            );
            assert!(took < Duration::from_secs(44), "{took:?}\n{context}");
            the_others_finished_at_world_size_4(&runs, d, &context);
            net.reconnect(leader);
            no_worker_left(d);
        }

        /// A cluster that takes TLS clients with certificates only: the
        /// launchers reach it with `--rdzv-conf`, and so do their workers
        /// (cpu-gloo bootstraps through it: an all-reduce over 2 machines).
        #[test]
        fn tls_with_client_certificates_reaches_launchers_and_workers() {
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path();
            accel_test_support::tls::certificates(d);
            let p = |f: &str| d.join(f).to_string_lossy().into_owned();
            let Some(c) = EtcdCluster::start_tls(
                &d.join("server.pem"),
                &d.join("server.key"),
                &d.join("ca.pem"),
            ) else {
                return;
            };
            let conf = format!(
                "cacert={},cert={},key={}",
                p("ca.pem"),
                p("client.pem"),
                p("client.key")
            );
            let eps = c.endpoint_list();
            let m = || {
                start(command(&argv(
                    "launch --nnodes 2 --rdzv-backend etcd --rdzv-id tls --backend cpu-gloo \
                     --rdzv-endpoint",
                    &[
                        &eps,
                        "--rdzv-conf",
                        &conf,
                        "--",
                        ACCEL,
                        "probe-worker",
                        "--accelerator",
                    ],
                )))
            };
            let (m0, m1) = (m(), m());
            let runs = [m0.finish(ELASTIC_LIMIT), m1.finish(ELASTIC_LIMIT)];
            let mut sums = Vec::new();
            for r in &runs {
                assert_eq!(r.code, Some(0), "{}", r.all());
                sums.extend(
                    r.stdout
                        .lines()
                        .filter_map(|l| l.find('{').map(|i| &l[i..]))
                        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                        .filter_map(|v| v.get("all_reduce_sum").and_then(|s| s.as_f64())),
                );
            }
            // 1 + 2 on both ranks.
            assert_eq!(sums, [3.0, 3.0], "{}\n{}", runs[0].all(), runs[1].all());
            // Without the client certificate the launcher cannot join.
            let r = start(command(&argv(
                "launch --nnodes 2 --rdzv-backend etcd --rdzv-id tls-2 --join-timeout 2s \
                 --rdzv-endpoint",
                &[
                    &eps,
                    "--rdzv-conf",
                    &format!("cacert={}", p("ca.pem")),
                    "--",
                    "true",
                ],
            )))
            .finish(Duration::from_secs(30));
            assert_eq!(r.code, Some(1), "{}", r.all());
            r.has_stderr(&c.endpoints()[0]);
        }

        #[test]
        fn a_lost_quorum_ends_every_machine_naming_the_cluster_and_a_new_run_resumes_after_it_returns(
        ) {
            let Some(mut c) = EtcdCluster::start(3) else {
                return;
            };
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path();
            // Two machines of 2:3 (the round closes after the join window),
            // slow steps: the run outlives the detection.
            let ms: Vec<Running> = (0..2)
                .map(|k| start(etcd_machine_on(None, &c, ("quorum", "1500"), d, k)))
                .collect();
            past_step_3(d, 2);
            let all = || errs(d, 2);
            c.kill(0);
            c.kill(1);
            let t = std::time::Instant::now();
            let runs: Vec<Run> = ms.into_iter().map(|m| m.finish(ELASTIC_LIMIT)).collect();
            let took = t.elapsed();
            // Within the timeout (20 s) + 2 s of silence, plus the workers'
            // stop (grace 2 s) and a loaded machine's slack.
            assert!(took < Duration::from_secs(40), "{took:?}\n{}", all());
            for (k, r) in runs.iter().enumerate() {
                assert_ne!(r.code, Some(0), "{}", all());
                let e = err(d, k);
                // Its heartbeat lost the cluster, or (its workers done first)
                // the agreement on the outcome did: the cluster and the quorum
                // are named either way.
                assert!(
                    e.contains("etcd cluster")
                        && e.contains("quorum")
                        && e.contains(&c.endpoints()[2]),
                    "machine {k}:\n{e}"
                );
            }
            no_worker_left(d);
            // The members come back; a new run (a new id) resumes from the
            // newest checkpoint (step 2 at the least) and finishes.
            c.restart(0);
            c.restart(1);
            let again: Vec<Run> = (0..2)
                .map(|k| start(etcd_machine_on(None, &c, ("quorum-2", "100"), d, k + 2)))
                .collect::<Vec<_>>()
                .into_iter()
                .map(|m| m.finish(ELASTIC_LIMIT))
                .collect();
            let both = format!("{}\n{}", err(d, 2), err(d, 3));
            for r in &again {
                assert_eq!(r.code, Some(0), "{both}");
            }
            let resumed = again
                .iter()
                .flat_map(|r| rank_lines(&r.stdout, 0))
                .find(|l| l.starts_with("resumed from"))
                .unwrap_or_default();
            let step: u64 = resumed
                .split(" at step ")
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            assert!(step >= 2, "{resumed:?}\n{both}");
            no_worker_left(d);
        }
    }

    /// The pids of `pid`'s children.
    fn children(pid: u32) -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }
}
