//! The rank tag: how a process whose ranks are threads marks each output
//! line with its rank for the launcher.

/// The first byte of a rank-tagged output line: `\x1e<rank>\x1f<line>`.
const TAG_START: u8 = 0x1e;
/// The byte that ends a line's rank tag.
const TAG_END: u8 = 0x1f;

/// `line` tagged with `rank`, as a rank thread writes it under
/// `accel launch` (the launcher strips the tag and prefixes `[rank N]`).
pub fn tag_line(rank: usize, line: &str) -> String {
    format!("{}{rank}{}{line}", TAG_START as char, TAG_END as char)
}

/// The rank and the text of a tagged line ([`tag_line`]); `None` for a line
/// without a well-formed tag.
pub fn untag_line(line: &[u8]) -> Option<(usize, &[u8])> {
    let rest = line.strip_prefix(&[TAG_START])?;
    let end = rest.iter().position(|&b| b == TAG_END)?;
    let digits = &rest[..end];
    if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let rank = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some((rank, &rest[end + 1..]))
}
