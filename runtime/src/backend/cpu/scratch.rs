//! Per-thread reusable f32 scratch. Kernels that need a few hundred KiB of temporaries per
//! task (widened weight panels, attention tiles) would otherwise get fresh pages from the
//! kernel on every call: `clear_page_erms` was 7 % of a 2048-token prefill profile.

use std::cell::RefCell;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `len` f32s of this thread's scratch (contents unspecified). If the scratch is
/// already in use further up this thread's stack (a rayon steal inside `f`), `f` gets a
/// fresh allocation instead of panicking.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            f(&mut v[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}
