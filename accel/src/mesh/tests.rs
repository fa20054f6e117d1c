//! `ParallelismConfig`'s rules, one row per invalid configuration, and the
//! mesh's arithmetic (the groups over rank threads: tests/mesh.rs).

use super::*;

fn cfg(dp_replicate: usize, dp_shard: usize, tp: usize, cp: usize) -> ParallelismConfig {
    ParallelismConfig {
        dp_replicate,
        dp_shard,
        tp,
        cp,
    }
}

fn vars(pairs: &[(&str, &str)]) -> Result<Option<ParallelismConfig>> {
    let pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    ParallelismConfig::from_vars(|k| {
        pairs
            .iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.clone())
    })
}

#[test]
fn every_invalid_configuration_is_refused_with_a_sentence_naming_it() {
    // (configuration, world size, what the error says)
    let table: [(ParallelismConfig, usize, &str); 10] = [
        (cfg(0, 2, 1, 1), 2, "dp_replicate_size is 0"),
        (cfg(1, 0, 1, 1), 2, "dp_shard_size is 0"),
        (cfg(1, 2, 0, 1), 2, "tp_size is 0"),
        (cfg(1, 2, 1, 0), 2, "cp_size is 0"),
        (
            cfg(1, 2, 1, 2),
            4,
            "cp_size=2 (context parallelism) is not supported",
        ),
        (
            cfg(2, 1, 2, 1),
            4,
            "tensor parallelism does not compose with pure replication",
        ),
        (cfg(1, 2, 2, 1), 8, "= 4 ranks, but the run has 8"),
        (cfg(2, 2, 1, 1), 3, "= 4 ranks, but the run has 3"),
        (cfg(1, 3, 1, 1), 4, "= 3 ranks, but the run has 4"),
        (cfg(2, 2, 2, 1), 4, "= 8 ranks, but the run has 4"),
    ];
    for (c, world, says) in table {
        let e = c.for_world(world).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{c:?}");
        let text = e.to_string();
        assert!(text.contains(says), "{c:?} at {world}: {text}");
        assert!(text.contains("parallelism config"), "{text}");
        assert!(e.fix().is_some(), "{c:?}: no fix in {text}");
    }
    // The environment's own mistakes.
    let env: [(&[(&str, &str)], &str); 5] = [
        (
            &[(DP_SHARD_SIZE_ENV, "two")],
            "PARALLELISM_CONFIG_DP_SHARD_SIZE=\"two\" is not a size",
        ),
        (
            &[(TP_SIZE_ENV, "-2")],
            "PARALLELISM_CONFIG_TP_SIZE=\"-2\" is not a size",
        ),
        (
            &[(TP_SIZE_ENV, "")],
            "PARALLELISM_CONFIG_TP_SIZE=\"\" is not a size",
        ),
        (&[(SP_SIZE_ENV, "2")], "sequence parallelism is DeepSpeed's"),
        (&[(CP_BACKEND_ENV, "ring")], "must be torch"),
    ];
    for (pairs, says) in env {
        let e = vars(pairs).unwrap_err();
        assert!(e.to_string().contains(says), "{pairs:?}: {e}");
    }
}

#[test]
fn valid_configurations_and_accelerates_defaults() {
    // Nothing set: no configuration; every size 1: the world replicated.
    assert_eq!(vars(&[]).unwrap(), None);
    assert_eq!(
        vars(&[(SP_SIZE_ENV, "1"), (CP_BACKEND_ENV, "torch")]).unwrap(),
        None
    );
    let one = ParallelismConfig::default().for_world(4).unwrap();
    assert_eq!(one, cfg(4, 1, 1, 1));
    assert_eq!(one.dims(), [("dp_replicate", 4)]);
    // Set sizes, the rest 1.
    let c = vars(&[(DP_SHARD_SIZE_ENV, "2"), (TP_SIZE_ENV, " 2 ")])
        .unwrap()
        .unwrap();
    assert_eq!(c, cfg(1, 2, 2, 1));
    assert_eq!(c.for_world(4).unwrap(), c);
    assert_eq!(c.dims(), [("dp_shard", 2), ("tp", 2)]);
    assert_eq!(c.data_parallel_size(), 2);
    // HSDP, HSDP + TP, FSDP + TP, pure TP (Accelerate allows all four).
    for c in [
        cfg(2, 2, 1, 1),
        cfg(2, 2, 2, 1),
        cfg(1, 4, 2, 1),
        cfg(1, 1, 4, 1),
    ] {
        assert_eq!(c.for_world(c.total()).unwrap(), c);
    }
    assert_eq!(
        cfg(2, 2, 2, 1).dims(),
        [("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)]
    );
    assert_eq!(ParallelismConfig::default().dims(), [("dp_replicate", 1)]);
}

#[test]
fn coordinates_are_row_major_over_the_dimensions() {
    // sizes [2, 3, 2]: rank = (a * 3 + b) * 2 + c.
    let sizes = [2, 3, 2];
    for rank in 0..12 {
        let coords = [rank / 6, (rank / 2) % 3, rank % 2];
        assert_eq!(linear(&coords, &sizes, &[0, 1, 2]), rank);
        // Within (a, c) fixed, b orders the group; (a, c) is its color.
        assert_eq!(linear(&coords, &sizes, &[1]), coords[1]);
        assert_eq!(linear(&coords, &sizes, &[0, 2]), coords[0] * 2 + coords[2]);
    }
}
