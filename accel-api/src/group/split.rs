//! [`SplitPlan`](crate::kit::SplitPlan): who is in which sub-group after a split, and the
//! sub-group's [`EngineInfo`].

use super::engine::{Engine, EngineInfo};
use crate::{Buf, BufMut, Error, HostBuf, HostBufMut, Op, Result};

/// Who is in which sub-group after a [`Communicator::split`](crate::Communicator::split): what every
/// engine needs to build its sub-group, computed from the `(color, key)` of
/// every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPlan {
    /// This rank's color (`None`: it opted out).
    pub color: Option<u32>,
    /// Index of this rank's color among the distinct colors in increasing
    /// order (for engines that want dense colors, like `MPI_Comm_split`).
    pub color_index: usize,
    /// Members of this rank's sub-group as parent ranks, ordered by
    /// `(key, parent rank)`: position `i` is the new rank `i`. Empty when
    /// `color` is `None`.
    pub members: Vec<usize>,
    /// This rank's rank in the sub-group.
    pub new_rank: usize,
}

impl SplitPlan {
    /// The plan of `rank` from every rank's `[color or -1, key]`, laid out
    /// rank-major (`all[2 * r]`, `all[2 * r + 1]`).
    ///
    /// # Errors
    /// [`ErrorKind::Internal`](crate::ErrorKind::Internal) when `all` does not have two entries per rank
    /// or does not contain this rank's own color.
    pub fn from_exchanged(rank: usize, color: Option<u32>, all: &[i64]) -> Result<SplitPlan> {
        if !all.len().is_multiple_of(2) || rank >= all.len() / 2 {
            return Err(Error::internal(
                Op::Split.name(),
                format!("split exchange has {} values for rank {rank}", all.len()),
            ));
        }
        let world = all.len() / 2;
        let Some(c) = color else {
            return Ok(SplitPlan {
                color: None,
                color_index: 0,
                members: Vec::new(),
                new_rank: 0,
            });
        };
        let c = i64::from(c);
        let mut distinct: Vec<i64> = (0..world).map(|r| all[2 * r]).filter(|&x| x >= 0).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let mut members: Vec<(i64, usize)> = (0..world)
            .filter(|&r| all[2 * r] == c)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let members: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        let new_rank = members.iter().position(|&r| r == rank).ok_or_else(|| {
            Error::internal(
                Op::Split.name(),
                "this rank is missing from its own color after the exchange",
            )
        })?;
        Ok(SplitPlan {
            color,
            color_index: distinct.iter().position(|&x| x == c).unwrap_or(0),
            members,
            new_rank,
        })
    }

    /// Exchange `(color, key)` with an all-gather of two `i64` per rank on
    /// host memory through `engine`, then compute the plan. For engines
    /// whose capabilities include host memory and `i64` all-gathers.
    ///
    /// # Errors
    /// The all-gather's errors.
    pub fn exchange<E: Engine>(engine: &E, color: Option<u32>, key: u32) -> Result<SplitPlan> {
        let mine = [color.map_or(-1, i64::from), i64::from(key)];
        let mut all = vec![0i64; 2 * engine.info().world_size];
        engine.all_gather(
            Buf::Host(HostBuf::from(&mine[..])),
            BufMut::Host(HostBufMut::from(&mut all[..])),
        )?;
        SplitPlan::from_exchanged(engine.info().rank, color, &all)
    }
}

impl EngineInfo {
    /// The identity of a sub-group made by `split`: same backend, device,
    /// timeout and capabilities, this rank's new rank and size.
    pub fn sub(&self, plan: &SplitPlan) -> EngineInfo {
        EngineInfo {
            rank: plan.new_rank,
            world_size: plan.members.len(),
            ..self.clone()
        }
    }
}
