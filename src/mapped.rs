//! A clear end for a process whose memory-mapped model file is cut short under it.
//!
//! Model files are memory-mapped (`.sfx` containers, GGUF files, safetensors). When such a file
//! is truncated while mapped, the next read of a page past the new end raises SIGBUS, and the
//! default action kills the process without a word: a `--json` run then leaves empty output
//! and exit status 135, indistinguishable from a crash. No recovery is sound at that point
//! (the faulting read is in the middle of a kernel), so the handler installed here writes one
//! line naming the file and exits with status 1, like any other error of the tools.
//!
//! Why not read through `pread` instead of the map: the ram tier's point is to serve
//! thousands of units per token straight from the page cache; a syscall per unit would cost
//! that path its speed. A file *replaced* by a rename (how `sfx-convert` writes) is another
//! inode and never affects a running process; only writing into the file in place does.

use std::os::raw::c_int;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The message the handler writes: a leaked `&'static [u8]`, swapped whole so the handler
/// never sees a half-updated one.
static MESSAGE: AtomicPtr<&'static [u8]> = AtomicPtr::new(std::ptr::null_mut());

extern "C" fn on_sigbus(_sig: c_int) {
    // Only async-signal-safe calls here: an atomic load, write(2) and _exit(2).
    let msg = MESSAGE.load(Ordering::Acquire);
    let bytes: &[u8] = if msg.is_null() {
        b"Error: bus error (SIGBUS) reading a memory-mapped file: it was truncated while in use\n"
    } else {
        // SAFETY: a non-null pointer was leaked by `set_message` and is never freed.
        unsafe { *msg }
    };
    // SAFETY: writes a valid buffer to stderr, then ends the process without unwinding.
    unsafe {
        libc::write(2, bytes.as_ptr().cast(), bytes.len());
        libc::_exit(1);
    }
}

fn set_message(text: String) {
    let leaked: &'static [u8] = Box::leak(text.into_bytes().into_boxed_slice());
    // The previous message (if any) is leaked too: a handler may be reading it right now.
    MESSAGE.store(Box::into_raw(Box::new(leaked)), Ordering::Release);
}

/// Installs the SIGBUS handler, naming `model` in its message. Called again (another model
/// file), it only updates the message. Failure to install is reported on stderr and ignored:
/// the tool still works, it only loses the clear message.
pub fn exit_clearly_on_sigbus(model: &Path) {
    set_message(format!(
        "Error: {}: bus error (SIGBUS) reading the memory-mapped file: it was truncated or \
         rewritten while in use; this run's output is incomplete and cannot be trusted \
         (replace a model by renaming a new file over it, never by writing into it)\n",
        model.display()
    ));
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // SAFETY: a zeroed sigaction with a plain handler, an empty mask and SA_ONSTACK (the
        // handler may run on a thread whose stack is nearly full; Rust installs alternate
        // signal stacks for its threads). Replaces std's SIGBUS handler, which on Linux only
        // reports stack overflows, and those arrive as SIGSEGV.
        let failed = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as extern "C" fn(c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0
        };
        if failed {
            eprintln!(
                "warning: could not install the SIGBUS handler ({}); a model file truncated \
                 while in use will end the process without a message",
                std::io::Error::last_os_error()
            );
        }
    });
}
