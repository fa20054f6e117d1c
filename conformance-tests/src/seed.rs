//! [`Seed`]: the run's shared seed, from which every property scenario
//! draws its cases.

/// The run's seed: 32 bytes shared by every rank through the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seed(pub [u8; 32]);

impl Seed {
    /// A seed from the OS clock and process id (not cryptographic; only
    /// needs to differ between runs).
    pub fn fresh() -> Seed {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Seed::from_u64(t as u64 ^ ((std::process::id() as u64) << 32))
    }

    /// A seed expanded from one number.
    pub fn from_u64(x: u64) -> Seed {
        let mut s = [0u8; 32];
        for (i, c) in s.chunks_mut(8).enumerate() {
            c.copy_from_slice(&mix(x.wrapping_add(i as u64)).to_le_bytes());
        }
        Seed(s)
    }

    /// Lower-case hex, as `ACCEL_CONFORMANCE_SEED` takes it.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parse 64 hex digits.
    pub fn parse(s: &str) -> Option<Seed> {
        let s = s.trim();
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Seed(out))
    }

    /// An independent seed for one scenario.
    pub fn derive(&self, name: &str) -> Seed {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        let mut out = self.0;
        for (i, c) in out.chunks_mut(8).enumerate() {
            let v =
                u64::from_le_bytes(c.try_into().expect("8 bytes")) ^ mix(h.wrapping_add(i as u64));
            c.copy_from_slice(&v.to_le_bytes());
        }
        Seed(out)
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_hex_round_trips_and_derives_independently() {
        let s = Seed::from_u64(42);
        assert_eq!(Seed::parse(&s.hex()), Some(s));
        assert_ne!(s.derive("a"), s.derive("b"));
        assert_eq!(s.derive("a"), s.derive("a"));
        assert_eq!(Seed::parse("zz"), None);
    }
}
