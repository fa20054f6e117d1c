//! Byte-level edits of fuzz inputs, and bytes that print as text in a
//! failure report (each crate's `tests/fuzz_*.rs` draws the edits that fit
//! its input).

/// One edit of a valid input; an index past the end wraps around.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// Flip a bit (the second field) of the byte at the first.
    FlipBit(usize, u8),
    /// Set the byte at the first field to the second.
    SetByte(usize, u8),
    /// Overwrite 4 bytes (a length or count field, often) with this value.
    SetU32(usize, u32),
    /// Keep this many bytes.
    Truncate(usize),
    /// Insert these bytes at the first field.
    Insert(usize, Vec<u8>),
    /// Remove up to the second field's count of bytes from the first.
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
