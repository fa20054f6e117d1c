//! A fixed, self-contained random generator for data order.
//!
//! Data order must be identical on every rank and must never change when a
//! dependency is upgraded, otherwise a checkpoint taken with one build resumes
//! with a different order under the next. So the generator is written here,
//! once: the ChaCha block function with 8 rounds (the same core as
//! `rand_chacha::ChaCha8Core`, with a 64-bit block counter and a 64-bit stream
//! id), and a Fisher–Yates shuffle drawing bounded integers with Lemire's
//! widening-multiply rejection method. The output depends only on the inputs:
//! no platform word size, no endianness, no crate version.

/// `"expand 32-byte k"`, the ChaCha constants.
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];

/// Run the ChaCha block function with `double_rounds` double rounds on
/// `input` and add the input back (RFC 8439 §2.3).
fn chacha_block(input: &[u32; 16], double_rounds: usize) -> [u32; 16] {
    #[inline(always)]
    fn qr(s: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize) {
        s[a] = s[a].wrapping_add(s[b]);
        s[d] = (s[d] ^ s[a]).rotate_left(16);
        s[c] = s[c].wrapping_add(s[d]);
        s[b] = (s[b] ^ s[c]).rotate_left(12);
        s[a] = s[a].wrapping_add(s[b]);
        s[d] = (s[d] ^ s[a]).rotate_left(8);
        s[c] = s[c].wrapping_add(s[d]);
        s[b] = (s[b] ^ s[c]).rotate_left(7);
    }
    let mut s = *input;
    for _ in 0..double_rounds {
        qr(&mut s, 0, 4, 8, 12);
        qr(&mut s, 1, 5, 9, 13);
        qr(&mut s, 2, 6, 10, 14);
        qr(&mut s, 3, 7, 11, 15);
        qr(&mut s, 0, 5, 10, 15);
        qr(&mut s, 1, 6, 11, 12);
        qr(&mut s, 2, 7, 8, 13);
        qr(&mut s, 3, 4, 9, 14);
    }
    for (o, i) in s.iter_mut().zip(input.iter()) {
        *o = o.wrapping_add(*i);
    }
    s
}

/// ChaCha8 keyed by a `u64` seed, on a `u64` stream.
///
/// # Behavior
/// The 256-bit key is the seed in little-endian order in its first two words
/// and zeros elsewhere; words 12–13 of the block are a 64-bit block counter
/// starting at 0 and words 14–15 the stream id. Words come out of each block
/// in order; [`next_u64`](Self::next_u64) joins two words low word first.
/// Equal `(seed, stream)` give equal sequences on every platform, forever.
#[derive(Clone, Debug)]
pub struct ChaCha8 {
    input: [u32; 16],
    block: [u32; 16],
    /// Next unread word of `block`; 16 means "generate the next block".
    pos: usize,
}

impl ChaCha8 {
    /// A generator for `seed` on stream `stream` (the data sampler uses the
    /// epoch as the stream, so every epoch has its own independent order).
    pub fn new(seed: u64, stream: u64) -> ChaCha8 {
        let mut input = [0u32; 16];
        input[..4].copy_from_slice(&SIGMA);
        input[4] = seed as u32;
        input[5] = (seed >> 32) as u32;
        input[14] = stream as u32;
        input[15] = (stream >> 32) as u32;
        ChaCha8 {
            input,
            block: [0; 16],
            pos: 16,
        }
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        if self.pos == 16 {
            self.block = chacha_block(&self.input, 4);
            let counter =
                (u64::from(self.input[13]) << 32 | u64::from(self.input[12])).wrapping_add(1);
            self.input[12] = counter as u32;
            self.input[13] = (counter >> 32) as u32;
            self.pos = 0;
        }
        let w = self.block[self.pos];
        self.pos += 1;
        w
    }

    /// The next 64 random bits (two words, low first).
    pub fn next_u64(&mut self) -> u64 {
        let lo = u64::from(self.next_u32());
        let hi = u64::from(self.next_u32());
        hi << 32 | lo
    }

    /// A uniform integer in `0..bound`.
    ///
    /// # Requires
    /// `bound > 0` (a zero bound returns 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound <= 1 {
            return 0;
        }
        // Lemire: the high word of x * bound is uniform once the low word
        // falls outside the biased zone.
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(bound);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

/// The permutation of `0..len` for `(seed, epoch)`.
///
/// # Behavior
/// Fisher–Yates from the last position down, drawing from
/// [`ChaCha8::new(seed, epoch)`](ChaCha8::new). Identical on every rank and
/// platform for equal inputs; different epochs give independent orders, and
/// unlike Accelerate's `seed + epoch` scheme `(seed 1, epoch 0)` and
/// `(seed 0, epoch 1)` are not the same order.
pub fn permutation(seed: u64, epoch: u64, len: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = ChaCha8::new(seed, epoch);
    for i in (1..len).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 8439 §2.3.2 block test vector, run with 20 rounds to check the
    /// block function itself (ChaCha8 is the same function with 8 rounds).
    #[test]
    fn rfc8439_block_vector() {
        let mut input = [0u32; 16];
        input[..4].copy_from_slice(&SIGMA);
        for (i, w) in input[4..12].iter_mut().enumerate() {
            let b = (4 * i) as u32;
            *w = u32::from_le_bytes([b as u8, (b + 1) as u8, (b + 2) as u8, (b + 3) as u8]);
        }
        input[12] = 1;
        input[13] = 0x0900_0000;
        input[14] = 0x4a00_0000;
        input[15] = 0;
        let out = chacha_block(&input, 10);
        let expected = [
            0xe4e7_f110,
            0x1559_3bd1,
            0x1fdd_0f50,
            0xc471_20a3,
            0xc7f4_d1c7,
            0x0368_c033,
            0x9aaa_2204,
            0x4e6c_d4c3,
            0x4664_82d2,
            0x09aa_9f07,
            0x05d7_c214,
            0xa202_8bd9,
            0xd19c_12b5,
            0xb94e_16de,
            0xe883_d0cb,
            0x4e3c_50a2,
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn permutation_is_a_permutation_and_depends_on_epoch() {
        let a = permutation(7, 0, 1000);
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        assert_ne!(a, permutation(7, 1, 1000));
        assert_ne!(a, permutation(8, 0, 1000));
        assert_eq!(a, permutation(7, 0, 1000));
        assert!(permutation(1, 2, 0).is_empty());
        assert_eq!(permutation(1, 2, 1), vec![0]);
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = ChaCha8::new(3, 4);
        for bound in [1u64, 2, 3, 7, 1000, u64::MAX] {
            for _ in 0..100 {
                assert!(r.below(bound) < bound);
            }
        }
    }
}
