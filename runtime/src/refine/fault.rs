//! Fault injection for the SSD tiers: a [`UnitReader`] that wraps a real one and makes reads
//! fail, come back short, come back slow or come back with a flipped bit, at given
//! probabilities, deterministically from a seed. Tests (and drills against a real file) use
//! it to check that a tier never applies bytes it did not verify and always falls back to the
//! resident precision with a warning.
//!
//! Determinism: the fate of a read is a hash of the seed, the offset and how many times that
//! offset was read before, so a run replays the same faults however the loader threads
//! interleave (as long as each offset is read the same number of times).

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::store::UnitReader;

/// Per-read fault probabilities (each in [0, 1], checked in this order: fail, short, flip,
/// slow; their sum at most 1, the rest of the reads are clean).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultPlan {
    pub seed: u64,
    /// The read returns an error without data.
    pub fail: f64,
    /// Half of the buffer is filled, then an `UnexpectedEof` error (what a read past a
    /// truncated end gives; the trait's contract makes a short read an error).
    pub short: f64,
    /// The read succeeds with one bit of one byte flipped (silent corruption).
    pub flip: f64,
    /// The read succeeds after `delay`.
    pub slow: f64,
    pub delay: Duration,
}

/// What a [`FaultReader`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub reads: u64,
    pub failed: u64,
    pub short: u64,
    pub flipped: u64,
    pub slow: u64,
}

impl FaultCounts {
    /// Reads that did not deliver the right bytes (slow ones do).
    pub fn faulty(&self) -> u64 {
        self.failed + self.short + self.flipped
    }
}

#[derive(Default)]
struct State {
    /// Reads so far per offset: the fault draw's second input.
    attempts: HashMap<u64, u64>,
    counts: FaultCounts,
}

/// A reader injecting the faults of a [`FaultPlan`] into the reads of `inner`.
pub struct FaultReader {
    inner: Arc<dyn UnitReader>,
    plan: FaultPlan,
    state: Mutex<State>,
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `x`.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

enum Fate {
    Clean,
    Fail,
    Short,
    Flip(u64),
    Slow,
}

impl FaultReader {
    pub fn new(inner: Arc<dyn UnitReader>, plan: FaultPlan) -> Self {
        FaultReader {
            inner,
            plan,
            state: Mutex::new(State::default()),
        }
    }

    pub fn counts(&self) -> FaultCounts {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .counts
    }

    fn fate(&self, offset: u64) -> Fate {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let n = st.attempts.entry(offset).or_insert(0);
        let attempt = *n;
        *n += 1;
        let h = mix(self.plan.seed ^ mix(offset ^ mix(attempt)));
        // 53 random bits as a uniform draw in [0, 1).
        let u = (h >> 11) as f64 / (1u64 << 53) as f64;
        let p = &self.plan;
        let fate = if u < p.fail {
            Fate::Fail
        } else if u < p.fail + p.short {
            Fate::Short
        } else if u < p.fail + p.short + p.flip {
            Fate::Flip(mix(h))
        } else if u < p.fail + p.short + p.flip + p.slow {
            Fate::Slow
        } else {
            Fate::Clean
        };
        st.counts.reads += 1;
        match fate {
            Fate::Fail => st.counts.failed += 1,
            Fate::Short => st.counts.short += 1,
            Fate::Flip(_) => st.counts.flipped += 1,
            Fate::Slow => st.counts.slow += 1,
            Fate::Clean => {}
        }
        fate
    }
}

impl UnitReader for FaultReader {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        match self.fate(offset) {
            Fate::Clean => self.inner.read_at(offset, buf),
            Fate::Fail => Err(io::Error::other("injected read failure")),
            Fate::Short => {
                let half = buf.len() / 2;
                self.inner.read_at(offset, &mut buf[..half])?;
                Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("injected short read: {half} of {} bytes", buf.len()),
                ))
            }
            Fate::Flip(r) => {
                self.inner.read_at(offset, buf)?;
                if !buf.is_empty() {
                    let i = (r % buf.len() as u64) as usize;
                    buf[i] ^= 1 << ((r >> 32) % 8);
                }
                Ok(())
            }
            Fate::Slow => {
                std::thread::sleep(self.plan.delay);
                self.inner.read_at(offset, buf)
            }
        }
    }
}
