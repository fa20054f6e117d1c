//! An append-only table whose entries never move, so `&self` can hand out
//! references into them while other threads keep appending (safe Rust:
//! every slot is a `OnceLock` in a chunk that is allocated once).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

const BASE: usize = 64;
const CHUNKS: usize = 40;

pub(crate) struct Arena<T> {
    chunks: [OnceLock<Box<[OnceLock<T>]>>; CHUNKS],
    next: AtomicUsize,
}

impl<T> std::fmt::Debug for Arena<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("len", &self.next.load(Ordering::Relaxed))
            .finish()
    }
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Arena {
            chunks: std::array::from_fn(|_| OnceLock::new()),
            next: AtomicUsize::new(0),
        }
    }
}

/// Chunk `c` holds `BASE << c` slots; returns (chunk, offset).
fn locate(i: usize) -> (usize, usize) {
    let q = i / BASE + 1;
    let c = (usize::BITS - 1 - q.leading_zeros()) as usize;
    (c, i - BASE * ((1 << c) - 1))
}

impl<T> Arena<T> {
    /// Append `v`; returns its slot number.
    pub(crate) fn push(&self, v: T) -> usize {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let (c, off) = locate(i);
        let chunk =
            self.chunks[c].get_or_init(|| (0..(BASE << c)).map(|_| OnceLock::new()).collect());
        if chunk[off].set(v).is_err() {
            unreachable!("arena slot {i} filled twice");
        }
        i
    }

    /// The value in slot `i`, once it has been pushed.
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        let (c, off) = locate(i);
        self.chunks.get(c)?.get()?.get(off)?.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_stable_across_chunks() {
        let a = Arena::default();
        for i in 0..1000usize {
            assert_eq!(a.push(i), i);
        }
        for i in 0..1000usize {
            assert_eq!(a.get(i), Some(&i));
        }
        assert_eq!(a.get(1000), None);
        assert_eq!(locate(0), (0, 0));
        assert_eq!(locate(63), (0, 63));
        assert_eq!(locate(64), (1, 0));
        assert_eq!(locate(191), (1, 127));
        assert_eq!(locate(192), (2, 0));
    }
}
