//! The training loop's random generator, with a state that checkpoints.

use serde::{Deserialize, Serialize};

/// xoshiro256++ seeded through SplitMix64: small, fast, and its whole state
/// is four words, so it is saved per rank in every checkpoint and restored
/// exactly.
///
/// # Behavior
/// This is the generator [`Accelerator::set_seed`](crate::Accelerator::set_seed)
/// seeds and [`Accelerator::rng`](crate::Accelerator::rng) hands out, for
/// the program's own randomness (dropout masks, augmentation, noise). Data
/// order does not use it: loaders shuffle with `accel-sharding`'s
/// permutation of `(seed, epoch)`. The sequence for a seed is fixed forever
/// (it is written here, not taken from a crate that may change it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator for `seed`.
    pub fn seed_from_u64(seed: u64) -> Rng {
        let mut x = seed;
        Rng {
            s: [
                splitmix(&mut x),
                splitmix(&mut x),
                splitmix(&mut x),
                splitmix(&mut x),
            ],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// A uniform `f32` in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// A standard normal `f32` (Box–Muller; two draws per value, no cached
    /// second value, so the state stays four words).
    pub fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64);
        let u2 = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// The raw state, for checkpoints and RNG synchronisation.
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// A generator at a saved state.
    pub fn from_state(s: [u64; 4]) -> Rng {
        Rng { s }
    }

    /// A generator for a rank a resumed run has and the saved one had not
    /// (an elastic restart that grew the world): seeded from this state and
    /// `salt`, so distinct from every saved rank's stream and the same in
    /// every resume.
    pub fn derived(&self, salt: u64) -> Rng {
        let mut x = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for w in self.s {
            x ^= w;
            x = splitmix(&mut x);
        }
        Rng::seed_from_u64(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_seeds_differ() {
        let mut a = Rng::seed_from_u64(7);
        a.next_u64();
        let mut b = Rng::from_state(a.state());
        assert_eq!(a.next_u64(), b.next_u64());
        assert_ne!(
            Rng::seed_from_u64(1).next_u64(),
            Rng::seed_from_u64(2).next_u64()
        );
        for _ in 0..1000 {
            let u = a.uniform();
            assert!((0.0..1.0).contains(&u));
            assert!(a.normal().is_finite());
        }
    }
}
