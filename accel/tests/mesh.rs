//! The device mesh over 4 rank threads on cpu-gloo: each group's ranks are
//! the ones the row-major mesh puts beside this rank (read back with an
//! all-gather inside the group), the joint groups are Accelerate's, and a
//! group the mesh does not have is an error naming the ones it has.

use std::time::Duration;

use accel::mesh::{DeviceMesh, ParallelismConfig};
use accel::{CommunicatorExt, ErrorKind, Threads};

/// Each group's name and the world ranks in it, as one rank saw them.
type Groups = Vec<(String, Vec<i32>)>;

/// For each group of `config`'s mesh on 4 ranks: per rank, its coordinates
/// and the world ranks of the group, gathered inside the group.
fn groups_on_4(config: ParallelismConfig) -> Vec<(Vec<usize>, Groups)> {
    Threads::new(4)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(|acc| {
            let mesh = DeviceMesh::new(acc.comm(), config)?;
            let coords = mesh
                .dims()
                .iter()
                .map(|(n, _)| mesh.coordinate(n))
                .collect();
            let mut out = Vec::new();
            for name in mesh.group_names() {
                let g = mesh.group(name)?;
                let members = g.all_gather_vec(&[acc.rank() as i32])?;
                out.push((name.to_string(), members));
            }
            Ok((coords, out))
        })
        .unwrap()
}

fn group<'a>(per_rank: &'a [(String, Vec<i32>)], name: &str) -> &'a [i32] {
    &per_rank.iter().find(|(n, _)| n == name).unwrap().1
}

#[test]
fn fsdp_and_tp_on_4_ranks_are_2_by_2_row_major() {
    let c = ParallelismConfig {
        dp_shard: 2,
        tp: 2,
        ..ParallelismConfig::default()
    };
    let all = groups_on_4(c);
    for (rank, (coords, groups)) in all.iter().enumerate() {
        assert_eq!(coords, &[rank / 2, rank % 2], "rank {rank}");
        let names: Vec<&str> = groups.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["dp", "dp_cp", "dp_shard", "dp_shard_cp", "tp"]);
        // tp: the neighbours of one data-parallel rank; dp_shard: one tp slot.
        let tp_base = (rank / 2 * 2) as i32;
        assert_eq!(group(groups, "tp"), [tp_base, tp_base + 1], "rank {rank}");
        let slot = (rank % 2) as i32;
        assert_eq!(group(groups, "dp_shard"), [slot, slot + 2], "rank {rank}");
        // Every joint over dp_shard alone is the dp_shard group.
        for joint in ["dp", "dp_shard_cp", "dp_cp"] {
            assert_eq!(
                group(groups, joint),
                [slot, slot + 2],
                "{joint} of rank {rank}"
            );
        }
    }
}

#[test]
fn hsdp_on_4_ranks_replicates_across_and_shards_within() {
    let c = ParallelismConfig {
        dp_replicate: 2,
        dp_shard: 2,
        ..ParallelismConfig::default()
    };
    let all = groups_on_4(c);
    for (rank, (coords, groups)) in all.iter().enumerate() {
        assert_eq!(coords, &[rank / 2, rank % 2], "rank {rank}");
        let r = rank as i32;
        let shard_base = r / 2 * 2;
        assert_eq!(group(groups, "dp_shard"), [shard_base, shard_base + 1]);
        assert_eq!(group(groups, "dp_replicate"), [r % 2, r % 2 + 2]);
        // dp and dp_cp: the whole world; dp_shard_cp: the shard group.
        assert_eq!(group(groups, "dp"), [0, 1, 2, 3]);
        assert_eq!(group(groups, "dp_cp"), [0, 1, 2, 3]);
        assert_eq!(group(groups, "dp_shard_cp"), [shard_base, shard_base + 1]);
    }
}

#[test]
fn the_accelerators_mesh_is_plain_data_parallel_without_a_config_and_errors_are_named() {
    let out = Threads::new(2)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(|acc| {
            let mesh = acc.device_mesh()?;
            // Built once: the same mesh again.
            assert!(std::sync::Arc::ptr_eq(&mesh, &acc.device_mesh()?));
            let e = mesh.group("tp").unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
            assert!(e.to_string().contains("no group \"tp\""), "{e}");
            let wrong = ParallelismConfig {
                dp_shard: 4,
                ..ParallelismConfig::default()
            };
            let e = DeviceMesh::new(acc.comm(), wrong).unwrap_err();
            assert!(e.to_string().contains("but the run has 2"), "{e}");
            Ok((mesh.dims(), mesh.group("dp")?.world_size()))
        })
        .unwrap();
    assert_eq!(out, vec![(vec![("dp_replicate", 2)], 2); 2]);
}
