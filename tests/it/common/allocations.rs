//! The allocations the calling thread makes, counted by this binary's global allocator (the
//! system allocator, counting): a test reads the count before and after what it measures, and
//! other threads' allocations do not add to it.
#![allow(unsafe_code)] // a `GlobalAlloc` is `unsafe` to implement; each call forwards as is

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting each allocation (and reallocation) of the calling thread.
pub struct Counting;

fn count() {
    // `try_with`: a thread's own teardown may allocate after its count is gone.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every method forwards its arguments unchanged to `System`, whose contract is the
// trait's; counting touches only a thread-local `Cell` and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's promise for `layout`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's promise for `ptr`, `layout` and `new_size`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's promise for `ptr` and `layout`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations the calling thread has made so far.
pub fn made() -> u64 {
    ALLOCATIONS.with(Cell::get)
}
