//! Seeded test data shared by the refinement-store test crates through `#[path]`.

/// Deterministic xorshift64*, so failures reproduce.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    (0..n).map(|_| rng.next() as u8).collect()
}
