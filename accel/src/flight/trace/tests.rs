//! The analysis on synthetic dumps: a skipped collective, a mismatch, crossed
//! sub-groups, a healthy snapshot, restarts and several dumps of a process,
//! the timeline's shape.

use super::*;
use crate::flight::GroupDump;
use accel_api::flight::GroupIdentity;

const T0: u64 = 1_700_000_000_000_000;

fn call(seq: u64, op: Op, count: u64, state: CallState) -> CallRecord {
    let issued_us = T0 + seq * 1_000;
    let ended = matches!(state, CallState::Completed | CallState::Failed);
    CallRecord {
        ticket: seq,
        seq: Some(seq),
        op,
        dtype: DType::F32,
        count,
        root: None,
        peer: None,
        reduce: (op == Op::AllReduce).then_some(ReduceOp::Sum),
        started_async: false,
        issued_us,
        started_us: issued_us + 10,
        ended_us: if ended {
            issued_us
                + if state == CallState::Failed {
                    3_000_000
                } else {
                    500
                }
        } else {
            0
        },
        state,
    }
}

/// `n` completed all-reduces of 4 elements, then `tail`.
fn ring(n: u64, tail: &[(Op, CallState)]) -> Vec<CallRecord> {
    let mut v: Vec<CallRecord> = (0..n)
        .map(|s| call(s, Op::AllReduce, 4, CallState::Completed))
        .collect();
    for (i, (op, st)) in tail.iter().enumerate() {
        let count = if *op == Op::Barrier { 0 } else { 4 };
        v.push(call(n + i as u64, *op, count, *st));
    }
    v
}

fn group(name: &str, rank: usize, world: usize, calls: Vec<CallRecord>) -> GroupDump {
    GroupDump {
        identity: GroupIdentity {
            backend: "cpu-gloo".into(),
            rank,
            world_size: world,
            name: name.into(),
        },
        calls,
    }
}

fn dump(rank: usize, world: usize, time_us: u64, groups: Vec<GroupDump>) -> DumpFile {
    DumpFile {
        path: PathBuf::from(format!("/d/rank{rank}-pid{}-0.json", 100 + rank)),
        dump: Dump {
            format: DUMP_FORMAT.into(),
            reason: "timeout: ...".into(),
            run_id: "r1".into(),
            rank: Some(rank),
            world_size: Some(world),
            restart: Some(0),
            host: "h".into(),
            pid: 100 + rank as u32,
            time_us,
            groups,
            ranks: Vec::new(),
        },
    }
}

fn run(files: &[DumpFile]) -> Trace {
    analyze(files, &Select::default()).unwrap()
}

/// Ranks 0 and 1 time out in all-reduce #4; rank 2 skipped it.
fn skipped(with_rank2: bool) -> Vec<DumpFile> {
    let late = T0 + 3_100_000;
    let waiting = &[(Op::AllReduce, CallState::Failed)];
    let mut v = vec![
        dump(0, 3, late, vec![group("world", 0, 3, ring(4, waiting))]),
        dump(1, 3, late, vec![group("world", 1, 3, ring(4, waiting))]),
    ];
    if with_rank2 {
        v.push(dump(2, 3, late, vec![group("world", 2, 3, ring(4, &[]))]));
    }
    v
}

#[test]
fn a_skipped_all_reduce_names_the_rank_and_the_sequence_number() {
    let t = run(&skipped(true));
    let w = &t.groups[0];
    assert_eq!(w.name, "world");
    let d = w.divergence.as_ref().expect("a divergence");
    assert_eq!((d.seq, d.kind), (4, DivergenceKind::Missing));
    assert_eq!(d.sides.len(), 2, "{d:?}");
    assert_eq!(d.sides[0].ranks, vec![0, 1]);
    assert_eq!(d.sides[0].call.unwrap().op, Op::AllReduce);
    assert_eq!(d.sides[1].ranks, vec![2]);
    assert!(d.sides[1].call.is_none());
    assert_eq!(d.sides[1].last, Some((3, CallState::Completed)));
    let stuck: Vec<(Option<usize>, Vec<usize>)> = t
        .stuck
        .iter()
        .map(|s| (s.rank, s.waiting_for_ranks.clone()))
        .collect();
    assert_eq!(stuck, vec![(Some(0), vec![2]), (Some(1), vec![2])]);
    assert!(t.cycles.is_empty());
    let text = t.render();
    assert!(text.contains("first divergence at #4"), "{text}");
    assert!(text.contains("rank(s) 2: never issued #4"), "{text}");
    assert!(text.contains("waiting for rank(s) 2"), "{text}");
}

#[test]
fn a_rank_without_a_dump_is_who_the_others_wait_for() {
    let t = run(&skipped(false));
    assert_eq!(t.ranks_without_dump, vec![2]);
    let d = t.groups[0].divergence.as_ref().unwrap();
    assert_eq!((d.seq, d.no_dump.clone()), (4, vec![2]));
    assert!(t.stuck.iter().all(|s| s.waiting_for_ranks == vec![2]));
}

#[test]
fn different_calls_under_one_number_are_a_mismatch() {
    let late = T0 + 3_100_000;
    let ar = &[(Op::AllReduce, CallState::Failed)];
    let files = vec![
        dump(0, 3, late, vec![group("world", 0, 3, ring(4, ar))]),
        dump(1, 3, late, vec![group("world", 1, 3, ring(4, ar))]),
        dump(
            2,
            3,
            late,
            vec![group(
                "world",
                2,
                3,
                ring(4, &[(Op::Barrier, CallState::Failed)]),
            )],
        ),
    ];
    let t = run(&files);
    let d = t.groups[0].divergence.as_ref().unwrap();
    assert_eq!((d.seq, d.kind), (4, DivergenceKind::Mismatch));
    assert_eq!(d.sides[0].ranks, vec![0, 1]);
    assert_eq!(d.sides[1].ranks, vec![2]);
    assert_eq!(d.sides[1].call.unwrap().op, Op::Barrier);
    let s2 = t.stuck.iter().find(|s| s.rank == Some(2)).unwrap();
    assert_eq!(s2.waiting_for_ranks, vec![0, 1]);
}

#[test]
fn sub_groups_called_in_opposite_orders_are_crossed() {
    let late = T0 + 3_100_000;
    let a = "world/split0:c1";
    let b = "world/split1:c1";
    let stuck = |seq_issue: u64| {
        let mut c = call(0, Op::AllReduce, 4, CallState::Failed);
        c.issued_us = T0 + seq_issue;
        vec![c]
    };
    let world = |r| group("world", r, 3, ring(2, &[]));
    let files = vec![
        // Rank 0: A first; rank 1: B first; rank 2 in neither.
        dump(
            0,
            3,
            late,
            vec![
                world(0),
                group(a, 0, 2, stuck(5_000)),
                group(b, 0, 2, vec![]),
            ],
        ),
        dump(
            1,
            3,
            late,
            vec![
                world(1),
                group(a, 1, 2, vec![]),
                group(b, 1, 2, stuck(5_000)),
            ],
        ),
        dump(2, 3, late, vec![world(2)]),
    ];
    let t = run(&files);
    let names: Vec<&str> = t.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, vec!["world", a, b]);
    assert!(t.groups[0].divergence.is_none());
    let da = t.groups[1].divergence.as_ref().unwrap();
    let db = t.groups[2].divergence.as_ref().unwrap();
    assert_eq!((da.seq, db.seq), (0, 0));
    assert_eq!(
        (da.sides[0].ranks.clone(), da.sides[1].ranks.clone()),
        (vec![0], vec![1])
    );
    assert_eq!(
        (db.sides[0].ranks.clone(), db.sides[1].ranks.clone()),
        (vec![1], vec![0])
    );
    assert_eq!(t.cycles, vec![vec![0, 1]]);
    assert!(
        t.render().contains("crossed: rank 0 -> rank 1 -> rank 0"),
        "{}",
        t.render()
    );
}

#[test]
fn a_healthy_snapshot_has_no_divergence() {
    // Rank 0 dumped while still inside #5; rank 1 had finished #5 and
    // issued #6. Rank 2 dumped between calls, before rank 1 issued #6.
    let mut r1 = ring(6, &[(Op::AllReduce, CallState::Started)]);
    r1[5].ended_us = r1[5].issued_us + 100;
    let files = vec![
        dump(
            0,
            3,
            T0 + 6_050,
            vec![group(
                "world",
                0,
                3,
                ring(5, &[(Op::AllReduce, CallState::Started)]),
            )],
        ),
        dump(1, 3, T0 + 6_100, vec![group("world", 1, 3, r1)]),
        dump(2, 3, T0 + 5_900, vec![group("world", 2, 3, ring(6, &[]))]),
    ];
    let t = run(&files);
    assert!(
        t.groups[0].divergence.is_none(),
        "{:?}",
        t.groups[0].divergence
    );
    assert!(t.cycles.is_empty());
}

#[test]
fn the_newest_dump_of_a_process_and_the_newest_restart_are_read() {
    let mut files = skipped(true);
    // An older dump of rank 0 (a signal, before the hang).
    let mut early = dump(0, 3, T0 + 100, vec![group("world", 0, 3, ring(1, &[]))]);
    early.path = PathBuf::from("/d/rank0-pid100-early.json");
    files.push(early);
    // A dump of an earlier attempt.
    let mut old = dump(0, 3, T0 - 1, vec![group("world", 0, 3, ring(9, &[]))]);
    old.dump.restart = Some(0);
    for f in &mut files {
        f.dump.restart = Some(1);
    }
    files.push(old);
    let t = run(&files);
    assert_eq!(t.restart, Some(1));
    assert_eq!(t.dumps.len(), 4, "the old attempt is left out");
    assert_eq!(t.dumps.iter().filter(|d| d.used).count(), 3);
    assert_eq!(t.groups[0].divergence.as_ref().unwrap().seq, 4);
    let t0 = analyze(
        &files,
        &Select {
            restart: Some(0),
            ..Select::default()
        },
    )
    .unwrap();
    assert_eq!(t0.groups[0].members.len(), 1);
}

#[test]
fn the_timeline_is_a_chrome_trace_with_one_track_per_rank_and_group() {
    let t = run(&skipped(true));
    let v = timeline(&t);
    let events = v["traceEvents"].as_array().unwrap();
    for e in events {
        for k in ["ph", "ts", "pid", "tid"] {
            assert!(e.get(k).is_some(), "{k} missing in {e}");
        }
    }
    let procs: Vec<i64> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| e["pid"].as_i64().unwrap())
        .collect();
    assert_eq!(procs, vec![0, 1, 2]);
    let complete = events.iter().filter(|e| e["ph"] == "X").count();
    assert_eq!(complete, 5 + 5 + 4);
    // The failed call lasts until it failed.
    let failed = events
        .iter()
        .find(|e| e["ph"] == "X" && e["name"] == "all_reduce #4")
        .unwrap();
    assert_eq!(failed["dur"], 3_000_000);
}

#[test]
fn the_timeline_draws_each_ranks_step_phases_from_its_dump() {
    use crate::watch::{Phase, Reporting, SectionTimeouts, Watch};
    let mut files = skipped(true);
    for (i, f) in files.iter_mut().enumerate() {
        let w = Watch::new(i, 3, SectionTimeouts::default(), Reporting::default());
        for _ in 0..2 {
            w.begin_step(false);
            for p in [Phase::Forward, Phase::Backward] {
                let before = w.enter_phase(p);
                w.leave_phase(p, std::time::Duration::from_millis(5), before);
            }
        }
        let st = w.status_with_phases();
        assert_eq!(st.recent_phases.len(), 4);
        assert_eq!(
            w.status().recent_phases.len(),
            0,
            "status files leave them out"
        );
        f.dump.ranks = vec![st];
    }
    let t = run(&files);
    assert_eq!(
        t.phases.iter().map(|p| p.rank).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    let v = timeline(&t);
    let events = v["traceEvents"].as_array().unwrap();
    for rank in 0..3 {
        let spans: Vec<(&str, u64, u64)> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == "phase" && e["pid"] == rank)
            .map(|e| {
                let name = e["name"].as_str().unwrap();
                (
                    name,
                    e["args"]["step"].as_u64().unwrap(),
                    e["dur"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            spans,
            [
                ("forward", 1, 5_000),
                ("backward", 1, 5_000),
                ("forward", 2, 5_000),
                ("backward", 2, 5_000)
            ],
            "rank {rank}"
        );
        let named = events
            .iter()
            .any(|e| e["ph"] == "M" && e["pid"] == rank && e["args"]["name"] == "steps (phases)");
        assert!(named, "rank {rank} has no steps track");
    }
}

#[test]
fn dumps_read_back_from_a_folder() {
    let dir = tempfile::tempdir().unwrap();
    for f in skipped(true) {
        let name = f.path.file_name().unwrap();
        std::fs::write(dir.path().join(name), serde_json::to_vec(&f.dump).unwrap()).unwrap();
    }
    std::fs::write(dir.path().join("other.json"), b"{}").unwrap();
    let (files, skipped) = read_dir(dir.path()).unwrap();
    assert_eq!((files.len(), skipped.len()), (3, 1));
    assert_eq!(run(&files).groups[0].divergence.as_ref().unwrap().seq, 4);
    let empty = tempfile::tempdir().unwrap();
    assert!(read_dir(empty.path()).is_err());
}
