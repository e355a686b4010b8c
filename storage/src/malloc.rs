//! glibc's malloc, tuned for a server whose memory is mostly its head.
//!
//! Two knobs, both no-ops on other C libraries:
//!
//! - [`tune`]: glibc gives each thread that allocates under contention
//!   an arena of its own, up to 8 per core. An ingest node hands its streams
//!   to short-lived blocking threads (`block_in_place`, `spawn_blocking`), so
//!   it reaches that cap, and every arena keeps its own free memory. With one
//!   arena per core, 1,000 GPUs' 2 hours held 66 MiB less (379 -> 313 MiB
//!   resident on 2 cores) at the same ingest rate (5.1 M samples/s).
//!   And glibc raises its mmap threshold to the largest block freed (up to
//!   32 MiB), after which a backfill's decode buffers and batches of a few
//!   MB come from the heaps and stay there, free, until a trim: fixed at
//!   128 KiB (the trim threshold at 1 MiB), the same backfill ended with
//!   20 MiB less resident (246, 247 -> 225, 228 MiB; docs/BENCHMARKS.md).
//! - [`release_free_memory`]: after a flush, and every 10 s in the server
//!   (`src/server.rs`), the free pages of every arena go back to the OS.

/// Caps glibc's malloc at one arena per available core, and fixes its mmap
/// threshold at [`MMAP_THRESHOLD`] and its trim threshold at
/// [`TRIM_THRESHOLD`], each unless the environment sets it (glibc reads
/// `MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`
/// and `GLIBC_TUNABLES` itself; they win). Call it first thing in `main`,
/// before threads start.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |var: &str| {
            std::env::var_os(var).is_some()
                || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| {
                    let name = var.trim_end_matches('_').trim_start_matches("MALLOC_");
                    t.to_ascii_uppercase().contains(name)
                })
        };
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let cap = libc::c_int::try_from(cores).unwrap_or(libc::c_int::MAX);
        for (var, param, value) in [
            ("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, cap),
            (
                "MALLOC_MMAP_THRESHOLD_",
                libc::M_MMAP_THRESHOLD,
                MMAP_THRESHOLD,
            ),
            (
                "MALLOC_TRIM_THRESHOLD_",
                libc::M_TRIM_THRESHOLD,
                TRIM_THRESHOLD,
            ),
        ] {
            if !set(var) {
                // SAFETY: `mallopt` takes no pointers; these parameters
                // only bound how many arenas glibc creates and which
                // blocks it maps or trims from now on.
                unsafe {
                    libc::mallopt(param, value);
                }
            }
        }
    }
}

/// Blocks this large or larger are mapped of their own, and unmapped when
/// freed (glibc's initial value, which it would otherwise raise).
pub const MMAP_THRESHOLD: i32 = 128 << 10;

/// Free memory at the top of a heap past this much goes back to the OS at
/// once.
pub const TRIM_THRESHOLD: i32 = 1 << 20;

/// Hands the memory the allocator holds free back to the OS. A flush
/// decodes and folds the whole head, and glibc's malloc keeps what it
/// freed, so a flush of a large head left the server that much larger for
/// good (1,000 GPUs x 2 h: 1.3 GB resident after the flush against 0.43 GB
/// before it); `malloc_trim` returns the free pages of every arena. Called
/// after a flush, after an upkeep round that did anything, and every 10 s by
/// the server.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointers and only walks glibc's own
    // arenas, under their locks; it is safe to call from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}
