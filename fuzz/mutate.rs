//! Byte-level edits of fuzz inputs, and bytes that print as text in a
//! failure report (included with `#[path]` by the crates' `tests/fuzz_*.rs`;
//! each harness draws the edits that fit its input).
#![allow(dead_code)]

/// One edit of a valid input; an index past the end wraps around.
#[derive(Debug, Clone)]
pub enum Mutation {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    /// Overwrite 4 bytes (a length or count field, often) with this value.
    SetU32(usize, u32),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

/// `p` with `muts` applied in order (an edit that needs bytes where there
/// are none does nothing).
pub fn apply(mut p: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
        match m {
            Mutation::FlipBit(i, b) if !p.is_empty() => {
                let i = at(*i, p.len());
                p[i] ^= 1 << b;
            }
            Mutation::SetByte(i, b) if !p.is_empty() => {
                let i = at(*i, p.len());
                p[i] = *b;
            }
            Mutation::SetU32(i, v) if p.len() >= 4 => {
                let i = at(*i, p.len() - 3);
                p[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            Mutation::Truncate(i) => {
                let i = at(*i, p.len() + 1);
                p.truncate(i);
            }
            Mutation::Insert(i, b) => {
                let i = at(*i, p.len() + 1);
                p.splice(i..i, b.iter().copied());
            }
            Mutation::Remove(i, n) if !p.is_empty() => {
                let i = at(*i, p.len());
                let end = (i + n).min(p.len());
                p.drain(i..end);
            }
            _ => {}
        }
    }
    p
}

/// Bytes that print as (lossy) text in a failure report.
#[derive(Clone)]
pub struct Text(pub Vec<u8>);

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(&self.0))
    }
}
