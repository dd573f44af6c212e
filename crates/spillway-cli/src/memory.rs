//! How the gateway's process uses memory, for both binaries that run it (`spillway serve`
//! and the desktop shell): no transparent huge pages, and freed pages given back to the
//! system once a request thread goes idle. Each binary also makes mimalloc its global
//! allocator (a library cannot choose that for the binary that links it).

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Turns transparent huge pages off for this process, before the runtime allocates.
///
/// mimalloc's arenas are 2 MiB aligned, so a kernel with transparent huge pages `always`
/// on backs them with huge pages: idle RSS 34 MiB instead of 20. The gateway's memory is
/// many small objects, which huge pages only inflate. A kernel without THP refuses the
/// call, and then there is nothing to turn off.
pub fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    let _ = rustix::thread::disable_transparent_huge_pages(true);
}

/// Gives what the allocator has freed back to the system once a request thread goes idle:
/// the runtime's `on_thread_park` hook.
///
/// mimalloc returns a freed page to the system a second after it was freed, but only when
/// a later allocation or free on the same thread notices that the second has passed. A
/// gateway that goes quiet after a burst makes no such call, so what the burst freed stayed
/// resident for good: 2,000 connections that each made a request and closed left the RSS
/// at 49 MiB, from 16 (18 with this). Run as the runtime parks a worker thread, at most
/// once a second per thread, so a busy one pays for it once a second. The engine's
/// once-a-second tick wakes the thread that drives the runtime's timers, whose next park
/// returns what its last freed, and purges the pages any thread gave back (arenas are
/// process-wide). With more than one request thread, one the tick does not wake keeps the
/// pages it freed in its last busy second until it next runs.
pub fn collect_freed_memory() {
    thread_local!(static LAST: Cell<Option<Instant>> = const { Cell::new(None) });
    let now = Instant::now();
    if LAST
        .get()
        .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
    {
        return;
    }
    LAST.set(Some(now));
    // SAFETY: mi_collect has no preconditions: it walks the calling thread's own heap and
    // the arenas' free lists, under mimalloc's own synchronisation.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_collect(false)
    };
}

/// The runtime both binaries run the gateway on: `workers` request threads, the memory
/// hook above, timers and I/O.
pub fn runtime(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .on_thread_park(collect_freed_memory)
        .enable_all()
        .build()
}
