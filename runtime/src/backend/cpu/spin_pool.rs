//! The fan-out of a decode step's small parallel loops: persistent workers that poll for the
//! next loop for a couple of milliseconds before they park.
//!
//! A decode token on the CPU is ~200 matvecs of 10–100 µs each, separated by serial work
//! (norms, attention, the refinement's selection). Rayon's idle workers fall asleep a few
//! microseconds into such a gap, and waking one is a futex round trip that lands after the
//! next matvec has started on the calling thread alone (measured: ~120 extra context switches
//! a refined token, rayon's `Sleep::sleep` the top entry). These workers instead spin through
//! the gaps, as llama.cpp's thread pool does, and only park after [`SPIN_FOR`] without work.
//!
//! One loop runs at a time: a call made while the pool is busy (another thread's loop, or a
//! loop inside a loop) runs on its calling thread.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker polls before it parks: longer than any serial gap inside a decode
/// step, short enough that an idle process stops burning a core almost at once.
const SPIN_FOR: Duration = Duration::from_millis(2);

/// How often (in polls) a spinning thread looks at the clock and yields to other runnable
/// threads (on a 2-core machine a third thread, e.g. a tier reader, may need the core).
const POLLS_PER_CHECK: u32 = 256;

type Job = dyn Fn(usize) + Sync;

/// The current loop. Written by the caller only while it holds `busy` and before it bumps
/// `epoch` (Release); read by workers only after they see the bump (Acquire) and before they
/// count themselves finished, while the caller waits for them.
struct JobSlot(UnsafeCell<*const Job>);

// SAFETY: access is ordered by `epoch` and `finished` as described on the type; the pointee
// is `Sync` and outlives every read (the caller returns only after all workers finished).
unsafe impl Sync for JobSlot {}
unsafe impl Send for JobSlot {}

struct Shared {
    epoch: AtomicU64,
    job: JobSlot,
    blocks: AtomicUsize,
    next: AtomicUsize,
    finished: AtomicUsize,
    panicked: AtomicBool,
    parked: AtomicUsize,
    park_lock: Mutex<()>,
    wake: Condvar,
}

/// The process-wide pool, sized from rayon's global pool (so `RAYON_NUM_THREADS` applies).
pub(crate) struct SpinPool {
    shared: &'static Shared,
    workers: usize,
    busy: Mutex<()>,
}

static POOL: OnceLock<SpinPool> = OnceLock::new();

/// The pool (created on first use).
pub(crate) fn pool() -> &'static SpinPool {
    POOL.get_or_init(|| SpinPool::new(rayon::current_num_threads().saturating_sub(1)))
}

impl SpinPool {
    /// A pool of `workers` threads besides the caller, which live as long as the process (the
    /// global one; tests make others to compare thread counts within one process).
    pub(crate) fn new(workers: usize) -> Self {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            epoch: AtomicU64::new(0),
            job: JobSlot(UnsafeCell::new(std::ptr::null::<fn(usize)>() as *const Job)),
            blocks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            park_lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        let mut started = 0;
        for i in 0..workers {
            let spawned = std::thread::Builder::new()
                .name(format!("sfx-decode-{i}"))
                .spawn(move || worker(shared, 0));
            if spawned.is_ok() {
                started += 1;
            }
        }
        Self {
            shared,
            workers: started,
            busy: Mutex::new(()),
        }
    }

    /// Threads a loop runs on: the workers and the caller.
    pub(crate) fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Runs `job(b)` once for every `b < blocks`, spread over the workers and the calling
    /// thread; returns when all have run.
    pub(crate) fn for_each_block(&self, blocks: usize, job: &(dyn Fn(usize) + Sync)) {
        let guard = match self.busy.try_lock() {
            Ok(g) if self.workers > 0 && blocks > 1 => g,
            _ => {
                (0..blocks).for_each(job);
                return;
            }
        };
        let s = self.shared;
        // SAFETY: only the `busy` holder writes the slot, and no worker reads it until the
        // epoch bump below; the lifetime is erased because this function does not return
        // before every worker has finished with the pointer.
        unsafe {
            *s.job.0.get() = std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Job>(
                job as *const _,
            );
        }
        s.blocks.store(blocks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.finished.store(0, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _lock = s.park_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let caller = catch_unwind(AssertUnwindSafe(|| run_blocks(s, job)));
        let mut polls = 0u32;
        while s.finished.load(Ordering::Acquire) < self.workers {
            std::hint::spin_loop();
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(POLLS_PER_CHECK) {
                std::thread::yield_now();
            }
        }
        let worker_panicked = s.panicked.swap(false, Ordering::Relaxed);
        drop(guard);
        if let Err(payload) = caller {
            std::panic::resume_unwind(payload);
        }
        if worker_panicked {
            panic!("a decode-pool worker panicked inside a parallel loop");
        }
    }

    /// Splits `data` into chunks of `per` elements and runs `f(index, chunk)` for each, in
    /// parallel; chunk `i` starts at element `i * per`.
    pub(crate) fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        per: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let per = per.max(1);
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        let chunk = |i: usize| {
            let start = i * per;
            let n = per.min(len - start);
            // SAFETY: `for_each_block` runs each index exactly once, so the chunks handed out
            // are disjoint sub-slices of `data`, which is borrowed mutably for the whole call.
            let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), n) };
            f(i, part)
        };
        self.for_each_block(len.div_ceil(per), &chunk);
    }
}

/// A raw pointer that may cross threads; the chunking above keeps its uses disjoint.
struct SendPtr<T>(*mut T);
// SAFETY: see `for_each_chunk_mut`: every thread gets a different chunk.
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

fn run_blocks(s: &Shared, job: &(dyn Fn(usize) + Sync + '_)) {
    let blocks = s.blocks.load(Ordering::Relaxed);
    loop {
        let b = s.next.fetch_add(1, Ordering::Relaxed);
        if b >= blocks {
            return;
        }
        job(b);
    }
}

/// `seen` is the epoch at spawn: a worker that starts late must still take the loops
/// published before it ran (the caller waits for every worker).
fn worker(s: &'static Shared, mut seen: u64) {
    loop {
        let mut polls = 0u32;
        let mut idle_since = Instant::now();
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            std::hint::spin_loop();
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(POLLS_PER_CHECK) {
                continue;
            }
            std::thread::yield_now();
            if idle_since.elapsed() < SPIN_FOR {
                continue;
            }
            let mut lock = s.park_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.parked.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen {
                // The timeout only guards against a lost wake-up; the caller notifies.
                lock = match s.wake.wait_timeout(lock, Duration::from_millis(100)) {
                    Ok((l, _)) => l,
                    Err(e) => e.into_inner().0,
                };
            }
            s.parked.fetch_sub(1, Ordering::SeqCst);
            idle_since = Instant::now();
        }
        // SAFETY: the epoch bump (Acquire above) published the slot; the caller keeps the job
        // alive until this worker counts itself finished below.
        let job = unsafe { &**s.job.0.get() };
        if catch_unwind(AssertUnwindSafe(|| run_blocks(s, job))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.finished.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once_with_its_own_elements() {
        let pool = SpinPool::new(3);
        for len in [0usize, 1, 7, 64, 1000] {
            for per in [1usize, 3, 64, 2000] {
                let mut data = vec![0u32; len];
                pool.for_each_chunk_mut(&mut data, per, |i, chunk| {
                    for (j, v) in chunk.iter_mut().enumerate() {
                        *v += (i * per + j) as u32 + 1;
                    }
                });
                let want: Vec<u32> = (1..=len as u32).collect();
                assert_eq!(data, want, "len {len} per {per}");
            }
        }
    }

    #[test]
    fn parked_workers_wake_for_the_next_loop() {
        let pool = SpinPool::new(2);
        let count = AtomicUsize::new(0);
        pool.for_each_block(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        // Polled rather than slept for: on a loaded machine a worker may not run for a while.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.shared.parked.load(Ordering::SeqCst) < 2 {
            assert!(Instant::now() < deadline, "idle workers never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The caller returns only after every worker has counted itself finished, so this
        // loop ending at all means both parked workers woke for it.
        pool.for_each_block(64, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 72);
    }

    #[test]
    fn nested_and_concurrent_loops_run_on_their_callers() {
        let pool = SpinPool::new(2);
        let total = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    pool.for_each_block(4, &|_| {
                        pool.for_each_block(5, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    });
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 4 * 5);
    }

    #[test]
    fn a_panic_in_a_block_reaches_the_caller_and_the_pool_goes_on() {
        let pool = SpinPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each_block(16, &|b| {
                if b == 11 {
                    panic!("block 11");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.for_each_block(16, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 16);
    }
}
