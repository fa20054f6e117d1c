//! `accel bench` end to end on the cpu-gloo backend: the table and the JSON
//! have one row per size with sane numbers (no timing assertions), every
//! operation runs, bad flags fail before anything starts. Each run is under
//! a hard deadline.
#![cfg(feature = "cpu-gloo")]

mod common;

use std::time::Duration;

use common::*;

fn sane(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

#[test]
fn table_has_one_sane_row_per_size() {
    let r = accel_words("bench -n 2 --backend cpu-gloo --op all_reduce --sizes 4K:16K --iters 3");
    r.code_is(0);
    assert!(
        r.stdout
            .starts_with("# accel bench: all_reduce on 2 ranks, backend cpu-gloo"),
        "{}",
        r.all()
    );
    let rows: Vec<Vec<&str>> = r
        .stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "{}", r.all());
    for (row, (size, count)) in rows.iter().zip([(4096, 1024), (8192, 2048), (16384, 4096)]) {
        assert_eq!(row.len(), 6, "{}", r.all());
        assert_eq!(row[0].parse::<u64>().unwrap(), size);
        assert_eq!(row[1].parse::<u64>().unwrap(), count);
        assert_eq!(row[2], "f32");
        let nums: Vec<f64> = row[3..].iter().map(|v| v.parse().unwrap()).collect();
        assert!(sane(nums[0]), "time: {}", r.all());
        // Printed with 3 decimals, bandwidths may round to 0.000.
        assert!(
            nums[1..].iter().all(|x| x.is_finite() && *x >= 0.0),
            "{}",
            r.all()
        );
        // 2 ranks: all_reduce's bus factor is 2(n-1)/n = 1.
        assert_eq!(row[4], row[5]);
    }
}

#[test]
fn json_has_the_same_rows() {
    let r = accel_words(
        "bench -n 2 --backend cpu-gloo --op all_reduce --sizes 4K:16K --iters 3 --json",
    );
    r.code_is(0);
    let v: serde_json::Value =
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.all()));
    assert_eq!(v["op"], "all_reduce");
    assert_eq!(v["backend"], "cpu-gloo");
    assert_eq!(v["world_size"], 2);
    assert_eq!(v["bus_factor"], 1.0);
    let rows = v["rows"].as_array().unwrap();
    let sizes: Vec<u64> = rows.iter().map(|r| r["size"].as_u64().unwrap()).collect();
    assert_eq!(sizes, vec![4096, 8192, 16384]);
    for row in rows {
        assert_eq!(
            row["count"].as_u64().unwrap() * 4,
            row["size"].as_u64().unwrap()
        );
        assert_eq!(row["dtype"], "f32");
        for k in ["time_us", "min_us", "algbw_gbs", "busbw_gbs"] {
            assert!(sane(row[k].as_f64().unwrap()), "{k}: {}", r.all());
        }
        assert!(row["min_us"].as_f64() <= row["time_us"].as_f64());
    }
}

#[test]
fn every_op_runs_on_three_ranks() {
    for op in [
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce_scatter",
        "all_to_all",
        "barrier",
    ] {
        let r = start(command(&argv(
            "bench -n 3 --backend cpu-gloo --op",
            &[
                op, "--sizes", "4K", "--iters", "2", "--warmup", "1", "--json",
            ],
        )))
        .finish(Duration::from_secs(60));
        assert_eq!(r.code, Some(0), "{op}: {}", r.all());
        let v: serde_json::Value =
            serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.all()));
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 1, "{op}: {}", r.all());
        let (size, count) = (rows[0]["size"].as_u64(), rows[0]["count"].as_u64());
        match op {
            "barrier" => assert_eq!((size, count), (Some(0), Some(0))),
            // One chunk per rank: 1024 elements round down to 1023.
            "all_gather" | "reduce_scatter" | "all_to_all" => {
                assert_eq!((size, count), (Some(4092), Some(1023)), "{op}")
            }
            _ => assert_eq!((size, count), (Some(4096), Some(1024)), "{op}"),
        }
        assert!(
            sane(rows[0]["time_us"].as_f64().unwrap()),
            "{op}: {}",
            r.all()
        );
    }
}

#[test]
fn bad_flags_fail_before_launching() {
    refused(&["bench", "--sizes", "64K:4K"], "MIN <= MAX");
    refused_words(
        "bench --op all_gather -n 4 --sizes 8 --dtype f64",
        "hold no whole f64 element per rank",
    );
}

#[test]
fn a_failing_worker_becomes_the_exit_code() {
    // An unknown backend: the workers fail to connect, the launcher reports
    // it, and bench exits non-zero without a table.
    let r = accel_words("bench -n 2 --backend no-such-backend --sizes 4K");
    assert_ne!(r.code, Some(0), "{}", r.all());
    assert!(!r.stdout.contains("size(B)"), "{}", r.all());
}
