//! Small shared helpers: byte sizes, checksums, name order and globs.

/// Parse a byte size: `40GiB`, `40 GB`, `512MiB`, `100MB`, `64KiB`, `64KB`,
/// `1024`, `1024B`, `1024bytes` (case-insensitive; decimal fractions allowed
/// with a unit, e.g. `1.5GiB`). GB/MB/KB are powers of 1000, GiB/MiB/KiB of
/// 1024, as in Accelerate.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.as_str() {
        "" | "b" | "bytes" | "byte" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    };
    if num.is_empty() {
        return None;
    }
    if num.contains('.') {
        let v: f64 = num.parse().ok()?;
        let r = v * mult as f64;
        (r.is_finite() && r >= 0.0 && r < u64::MAX as f64).then_some(r as u64)
    } else {
        num.parse::<u64>().ok()?.checked_mul(mult)
    }
}

/// Human-readable bytes with binary units (`1.50 GiB`).
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// 64-bit FNV-1a over 8-byte words (tail bytewise): a fast, dependency-free
/// checksum for tests and load verification, not a cryptographic hash.
pub fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3);
    }
    for &b in chunks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ data.len() as u64
}

/// The planner's file checks live in `accel-api`, shared with the
/// training loop's loaders and the plugin loader.
pub use accel_api::files::{open_regular, read_regular};

/// Compare path components naturally: numeric components numerically
/// (`2` < `10`), numbers before names, names bytewise.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let na =
        (!a.is_empty() && a.bytes().all(|c| c.is_ascii_digit())).then(|| a.trim_start_matches('0'));
    let nb =
        (!b.is_empty() && b.bytes().all(|c| c.is_ascii_digit())).then(|| b.trim_start_matches('0'));
    match (na, nb) {
        (Some(x), Some(y)) => x
            .len()
            .cmp(&y.len())
            .then_with(|| x.cmp(y))
            .then_with(|| a.cmp(b)),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => a.cmp(b),
    }
}

/// A tiny glob: `*` matches any run of characters (dots included), every
/// other character matches itself.
pub(crate) fn glob_match(pattern: &str, text: &str) -> bool {
    let p = pattern.as_bytes();
    let t = text.as_bytes();
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && p[pi] != b'*' && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == b'*' {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_every_unit() {
        assert_eq!(parse_size("40GiB"), Some(40 << 30));
        assert_eq!(parse_size("40GB"), Some(40_000_000_000));
        assert_eq!(parse_size("512 MiB"), Some(512 << 20));
        assert_eq!(parse_size("3MB"), Some(3_000_000));
        assert_eq!(parse_size("2KiB"), Some(2048));
        assert_eq!(parse_size("2kb"), Some(2000));
        assert_eq!(parse_size("1234"), Some(1234));
        assert_eq!(parse_size("1234bytes"), Some(1234));
        assert_eq!(parse_size("1.5GiB"), Some(3 << 29));
        assert_eq!(parse_size("GiB"), None);
        assert_eq!(parse_size("12 parsecs"), None);
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
    }

    #[test]
    fn natural_order_and_glob() {
        let mut v = vec!["10", "2", "norm", "1", "embed"];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(v, ["1", "2", "10", "embed", "norm"]);
        assert!(glob_match("model.layers.*", "model.layers.3"));
        assert!(glob_match("*.mlp", "model.layers.3.mlp"));
        assert!(!glob_match("*.mlp", "model.layers.3.mlp.up"));
        assert!(glob_match("lm_head", "lm_head"));
        assert!(!glob_match("lm_head", "lm_head2"));
    }

    #[test]
    fn checksums_differ() {
        assert_ne!(checksum(b"abc"), checksum(b"abd"));
    }
}
