//! A fault injector for the WAL's file writes (tests only): a byte budget
//! shared by every file the writer touches. A write that would pass the
//! budget writes the bytes that fit, as a file system that runs full does
//! (a short write), and then fails with `ENOSPC`.

use std::fs::File;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

#[derive(Debug)]
pub(crate) struct Fault {
    /// Bytes that may still be written; `u64::MAX`: no limit.
    budget: AtomicU64,
    /// `set_len` fails with `EIO` (the cut-back after a failed write fails too).
    fail_set_len: AtomicBool,
    /// Writes that were cut short or refused.
    pub(crate) failures: AtomicU64,
}

impl Default for Fault {
    fn default() -> Self {
        Self {
            budget: AtomicU64::new(u64::MAX),
            fail_set_len: AtomicBool::new(false),
            failures: AtomicU64::new(0),
        }
    }
}

impl Fault {
    /// From now on, `bytes` more bytes fit on the "disk".
    pub(crate) fn fill_after(&self, bytes: u64) {
        self.budget.store(bytes, SeqCst);
    }

    /// Space is back.
    pub(crate) fn free(&self) {
        self.budget.store(u64::MAX, SeqCst);
    }

    pub(crate) fn set_len_fails(&self, on: bool) {
        self.fail_set_len.store(on, SeqCst);
    }

    pub(crate) fn check_set_len(&self) -> io::Result<()> {
        if self.fail_set_len.load(SeqCst) {
            return Err(io::Error::from_raw_os_error(EIO));
        }
        Ok(())
    }

    /// `f.write_all(bytes)` on a disk with the remaining budget.
    pub(crate) fn write_all(&self, f: &mut File, bytes: &[u8]) -> io::Result<()> {
        let budget = self.budget.load(SeqCst);
        let fit = (bytes.len() as u64).min(budget) as usize;
        f.write_all(&bytes[..fit])?;
        if budget != u64::MAX {
            self.budget.store(budget - fit as u64, SeqCst);
        }
        if fit < bytes.len() {
            self.failures.fetch_add(1, SeqCst);
            return Err(io::Error::from_raw_os_error(ENOSPC));
        }
        Ok(())
    }
}

/// `ENOSPC` on Linux.
const ENOSPC: i32 = 28;
/// `EIO` on Linux.
const EIO: i32 = 5;
