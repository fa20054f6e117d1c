//! How a tensor is laid out on a device mesh (issue 39's placements, read
//! and written by checkpoints): per mesh dimension, the tensor is
//! replicated, sharded along one of its dimensions, or a partial sum to
//! be reduced. The same three kinds as torch's DTensor (`Replicate`,
//! `Shard(dim)`, `Partial`), with its chunking: a dimension of `n` split
//! `k` ways gives chunks of `ceil(n / k)`, the last ones shorter or empty.
//! Several mesh dimensions may shard the same tensor dimension: the outer
//! mesh dimension splits it first, the inner one splits each chunk
//! (FSDP's dim 0 under tensor parallelism's, for instance).
//!
//! Pure arithmetic on shapes and index ranges: no tensors, no
//! communication. [`Layout::local_box`] is what one rank holds,
//! [`Layout::boxes`] what every rank holds, [`intersect`] what a rank of
//! one layout needs from a rank of another (resharding).

use std::ops::Range;

use accel_api::{Error, Result};
use serde::{Deserialize, Serialize};

/// How a tensor sits along one mesh dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Every rank along the dimension holds the same data.
    Replicate,
    /// Split along tensor dimension `dim`.
    Shard {
        /// The tensor dimension.
        dim: usize,
    },
    /// Each rank holds a partial sum: the tensor is their sum.
    Partial,
}

/// A tensor's global shape and its placement on each mesh dimension.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// The mesh's dimension sizes, outermost first.
    pub mesh: Vec<usize>,
    /// One placement per mesh dimension.
    pub placements: Vec<Placement>,
}

/// Per tensor dimension, a range of indices: a region of the tensor.
pub type Region = Vec<Range<usize>>;

/// The chunk `i` of `k` of `0..n`, as torch's `chunk`: `ceil(n / k)`
/// each, the last ones shorter or empty.
pub fn chunk(n: usize, k: usize, i: usize) -> Range<usize> {
    let size = n.div_ceil(k.max(1));
    let start = (i * size).min(n);
    start..(start + size).min(n)
}

impl Layout {
    /// A layout, checked: one placement per mesh dimension, sizes at least
    /// 1, shard dimensions inside the shape.
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::InvalidArgument`] naming what is wrong.
    pub fn new(shape: Vec<usize>, mesh: Vec<usize>, placements: Vec<Placement>) -> Result<Layout> {
        let bad = |why: String| Error::invalid_argument("placement", why);
        if mesh.len() != placements.len() {
            return Err(bad(format!(
                "{} placement(s) for a mesh of {} dimension(s)",
                placements.len(),
                mesh.len()
            )));
        }
        if let Some(d) = mesh.iter().position(|&s| s == 0) {
            return Err(bad(format!("mesh dimension {d} has size 0")));
        }
        for (d, p) in placements.iter().enumerate() {
            if let Placement::Shard { dim } = p {
                if *dim >= shape.len() {
                    return Err(bad(format!(
                        "mesh dimension {d} shards tensor dimension {dim}, but the tensor has {} \
                         dimension(s) (shape {shape:?})",
                        shape.len()
                    )));
                }
            }
        }
        Ok(Layout {
            shape,
            mesh,
            placements,
        })
    }

    /// The box the rank at mesh coordinates `coords` holds.
    ///
    /// # Errors
    /// Coordinates of the wrong length or outside the mesh.
    pub fn local_box(&self, coords: &[usize]) -> Result<Region> {
        if coords.len() != self.mesh.len() || coords.iter().zip(&self.mesh).any(|(c, s)| c >= s) {
            return Err(Error::invalid_argument(
                "placement",
                format!("coordinates {coords:?} are not in the mesh {:?}", self.mesh),
            ));
        }
        let mut b: Region = self.shape.iter().map(|&n| 0..n).collect();
        for ((p, &size), &c) in self.placements.iter().zip(&self.mesh).zip(coords) {
            if let Placement::Shard { dim } = *p {
                let r = &b[dim];
                let sub = chunk(r.len(), size, c);
                b[dim] = r.start + sub.start..r.start + sub.end;
            }
        }
        Ok(b)
    }

    /// Every rank's box, in row-major mesh order.
    pub fn boxes(&self) -> Vec<Region> {
        let total: usize = self.mesh.iter().product();
        (0..total)
            .map(|r| {
                let mut coords = vec![0; self.mesh.len()];
                let mut rest = r;
                for d in (0..self.mesh.len()).rev() {
                    coords[d] = rest % self.mesh[d];
                    rest /= self.mesh[d];
                }
                self.local_box(&coords)
                    .expect("coordinates inside the mesh")
            })
            .collect()
    }

    /// `true` when some mesh dimension holds partial sums.
    pub fn is_partial(&self) -> bool {
        self.placements.contains(&Placement::Partial)
    }
}

/// The elements of box `b`.
pub fn volume(b: &[Range<usize>]) -> usize {
    b.iter().map(ExactSizeIterator::len).product()
}

/// The common part of two boxes of one tensor, if any: what a rank
/// holding `a` sends a rank that needs `b`.
pub fn intersect(a: &[Range<usize>], b: &[Range<usize>]) -> Option<Region> {
    let out: Region = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.start.max(y.start)..x.end.min(y.end))
        .collect();
    (a.len() == b.len() && out.iter().all(|r| r.start < r.end)).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn chunks_are_torch_s() {
        let got: Vec<_> = (0..4).map(|i| chunk(10, 4, i)).collect();
        assert_eq!(got, vec![0..3, 3..6, 6..9, 9..10]);
        // More chunks than elements: the last ones empty.
        let got: Vec<_> = (0..4).map(|i| chunk(2, 4, i)).collect();
        assert_eq!(got, vec![0..1, 1..2, 2..2, 2..2]);
    }

    #[test]
    fn fsdp_and_tp_on_one_matrix() {
        // dp_shard=2 shards rows, tp=2 then shards columns.
        let l = Layout::new(
            vec![6, 4],
            vec![2, 2],
            vec![Placement::Shard { dim: 0 }, Placement::Shard { dim: 1 }],
        )
        .unwrap();
        assert_eq!(l.local_box(&[1, 0]).unwrap(), vec![3..6, 0..2]);
        // Both on dim 0: the outer splits, the inner splits each part.
        let l = Layout::new(
            vec![8],
            vec![2, 2],
            vec![Placement::Shard { dim: 0 }, Placement::Shard { dim: 0 }],
        )
        .unwrap();
        let got: Vec<_> = l.boxes().into_iter().map(|b| b[0].clone()).collect();
        assert_eq!(got, vec![0..2, 2..4, 4..6, 6..8]);
    }

    #[test]
    fn bad_layouts_are_named() {
        let e = Layout::new(vec![4], vec![2], vec![Placement::Shard { dim: 1 }]).unwrap_err();
        assert!(e.to_string().contains("tensor dimension 1"), "{e}");
        assert!(Layout::new(vec![4], vec![2, 2], vec![Placement::Replicate]).is_err());
        assert!(Layout::new(vec![4], vec![0], vec![Placement::Replicate]).is_err());
        let l = Layout::new(vec![4], vec![2], vec![Placement::Partial]).unwrap();
        assert!(l.is_partial());
        assert!(l.local_box(&[2]).is_err());
        let json = serde_json::to_string(&l).unwrap();
        assert!(json.contains("\"partial\""), "{json}");
        assert_eq!(serde_json::from_str::<Layout>(&json).unwrap(), l);
    }

    fn layouts() -> impl Strategy<Value = Layout> {
        (
            prop::collection::vec(1usize..9, 1..4),
            prop::collection::vec(1usize..4, 1..4),
        )
            .prop_flat_map(|(shape, mesh)| {
                let ndim = shape.len();
                let place = prop_oneof![
                    Just(Placement::Replicate),
                    (0..ndim).prop_map(|dim| Placement::Shard { dim }),
                ];
                let n = mesh.len();
                (Just(shape), Just(mesh), prop::collection::vec(place, n))
            })
            .prop_map(|(s, m, p)| Layout::new(s, m, p).unwrap())
    }

    proptest! {
        /// The distinct boxes of a layout tile the tensor exactly once.
        #[test]
        fn boxes_tile_the_tensor(l in layouts()) {
            let mut distinct: Vec<Region> = Vec::new();
            for b in l.boxes() {
                if volume(&b) > 0 && !distinct.contains(&b) {
                    distinct.push(b);
                }
            }
            let total: usize = l.shape.iter().product();
            prop_assert_eq!(distinct.iter().map(|b| volume(b)).sum::<usize>(), total);
            for (i, a) in distinct.iter().enumerate() {
                for b in &distinct[i + 1..] {
                    prop_assert!(intersect(a, b).is_none(), "{:?} and {:?} overlap", a, b);
                }
            }
        }

        /// Resharding: every box of a new layout is covered exactly by its
        /// intersections with the old layout's distinct boxes.
        #[test]
        fn intersections_cover_any_other_layout(a in layouts(), mesh in prop::collection::vec(1usize..4, 1..3)) {
            let n = mesh.len();
            let b = Layout::new(a.shape.clone(), mesh, vec![Placement::Shard { dim: 0 }; n]).unwrap();
            let mut old: Vec<Region> = Vec::new();
            for x in a.boxes() {
                if volume(&x) > 0 && !old.contains(&x) {
                    old.push(x);
                }
            }
            for need in b.boxes() {
                let got: usize = old.iter().filter_map(|o| intersect(o, &need)).map(|x| volume(&x)).sum();
                prop_assert_eq!(got, volume(&need));
            }
        }
    }
}
