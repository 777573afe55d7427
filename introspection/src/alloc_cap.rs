//! Test-only global allocator: a test can cap the size of any single allocation made on
//! its own thread, so that "this guest input makes the host allocate gigabytes" fails the
//! test (the refused allocation aborts the test binary with "memory allocation of N bytes
//! failed") instead of exhausting the machine the tests run on. Other threads, and the
//! test's own thread outside [`with_cap`], allocate as usual.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// The largest allocation allowed on this thread; 0: no cap.
    static CAP: Cell<usize> = const { Cell::new(0) };
}

struct Capped;

fn refused(size: usize) -> bool {
    // `try_with`: during thread teardown the slot may be gone; no cap then.
    CAP.try_with(|c| c.get() != 0 && size > c.get()).unwrap_or(false)
}

// SAFETY: every call is forwarded unchanged to the system allocator, except that an
// over-cap request returns null, which GlobalAlloc allows (allocation failure).
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if refused(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if refused(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if refused(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr`/`layout` came from `System` through this allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Capped = Capped;

/// Runs `f` with every single allocation on this thread limited to `cap` bytes.
pub(crate) fn with_cap<T>(cap: usize, f: impl FnOnce() -> T) -> T {
    let old = CAP.with(|c| c.replace(cap));
    let out = f();
    CAP.with(|c| c.set(old));
    out
}
