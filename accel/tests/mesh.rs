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

/// A data set of `len` positions (each item is its index).
struct Positions(usize);

impl accel::train::Dataset for Positions {
    type Item = usize;
    fn len(&self) -> usize {
        self.0
    }
    fn get(&self, index: usize) -> usize {
        index
    }
}

/// What one rank saw of the data: its batches' items for an epoch of 21
/// positions in batches of 4 (the last one topped up), the epoch gathered
/// with `gather_for_metrics`, `reduce(sum)` of 1, and its
/// `split_between_processes` share of 0..10.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    batches: Vec<Vec<usize>>,
    gathered: Vec<usize>,
    ones: u64,
    share: Vec<usize>,
}

fn data_on(world: usize, config: Option<ParallelismConfig>) -> Vec<Seen> {
    Threads::new(world)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(|acc| {
            if let Some(c) = config {
                acc.set_parallelism_config(c)?;
            }
            let mut loader = acc.prepare_loader(accel::train::DataLoader::new(Positions(21), 4))?;
            let (mut batches, mut gathered) = (Vec::new(), Vec::new());
            while let Some(b) = loader.next_batch() {
                let items: Vec<u64> = b.items.iter().map(|&i| i as u64).collect();
                gathered.extend(
                    acc.gather_for_metrics(&items, &b)?
                        .iter()
                        .map(|&i| i as usize),
                );
                batches.push(b.items);
            }
            let ones = acc.reduce(&[1u64], "sum")?[0];
            let items: Vec<usize> = (0..10).collect();
            let share = acc.split_between_processes(&items).to_vec();
            Ok(Seen {
                batches,
                gathered,
                ones,
                share,
            })
        })
        .unwrap()
}

/// dp_shard 2 × tp 2 on 4 ranks: ranks 0-1 and 2-3 are tensor-parallel
/// pairs. Each pair reads what rank 0 and rank 1 of plain 2-rank data
/// parallelism read; metrics and reductions count each pair once.
#[test]
fn data_follows_the_data_parallel_ranks_of_the_mesh() {
    let fsdp_tp = ParallelismConfig {
        dp_shard: 2,
        tp: 2,
        ..ParallelismConfig::default()
    };
    let mesh = data_on(4, Some(fsdp_tp));
    let plain = data_on(2, None);
    for (rank, seen) in mesh.iter().enumerate() {
        let dp = rank / 2;
        assert_eq!(seen.batches, plain[dp].batches, "rank {rank}");
        assert_eq!(seen.share, plain[dp].share, "rank {rank}");
        assert_eq!(seen.ones, 2, "rank {rank}: one per data-parallel rank");
        let mut all = seen.gathered.clone();
        all.sort_unstable();
        assert_eq!(
            all,
            (0..21).collect::<Vec<_>>(),
            "rank {rank}: every sample once"
        );
    }
    assert_ne!(mesh[0].batches, mesh[2].batches);
}

/// Tensor parallel alone (tp 4): every rank is the one data-parallel rank,
/// reads everything, and its metrics are its own.
#[test]
fn pure_tensor_parallel_ranks_all_read_the_whole_data() {
    let tp = ParallelismConfig {
        tp: 4,
        ..ParallelismConfig::default()
    };
    let single = data_on(1, None);
    for (rank, seen) in data_on(4, Some(tp)).iter().enumerate() {
        assert_eq!(seen, &single[0], "rank {rank}");
    }
}

#[test]
fn the_parallelism_is_set_before_the_mesh_is_built() {
    let errors = Threads::new(4)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(|acc| {
            let dp4 = acc.parallelism_config();
            assert_eq!(dp4.data_parallel_size(), 4);
            acc.device_mesh()?;
            // The same configuration again is fine; another is refused.
            acc.set_parallelism_config(dp4)?;
            let e = acc
                .set_parallelism_config(ParallelismConfig {
                    dp_shard: 2,
                    tp: 2,
                    ..ParallelismConfig::default()
                })
                .unwrap_err();
            // An impossible one is refused with the rule.
            let bad = acc
                .set_parallelism_config(ParallelismConfig {
                    tp: 3,
                    ..ParallelismConfig::default()
                })
                .unwrap_err();
            Ok((e.to_string(), bad.kind().clone()))
        })
        .unwrap();
    for (e, bad) in errors {
        assert!(e.contains("already built"), "{e}");
        assert_eq!(bad, ErrorKind::InvalidArgument);
    }
}
