//! The file writes of the WAL (`storage`) and the agent's spool, behind one
//! seam: [`FileIo`] calls `std::fs`, unless a test gave it a [`Fault`], a
//! byte budget shared by every file the writer touches. A write that would
//! pass the budget writes the bytes that fit, as a file system that runs
//! full does (a short write), and then fails with `ENOSPC`; `set_len` can be
//! made to fail with `EIO`, so that the cut-back after a failed write fails
//! too.

use std::fs::File;
use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

/// File writes, through a [`Fault`] when a test set one.
#[derive(Debug, Default, Clone)]
pub struct FileIo {
    pub fault: Option<Arc<Fault>>,
}

impl FileIo {
    /// File writes through `fault`.
    pub fn with_fault(fault: Arc<Fault>) -> Self {
        Self { fault: Some(fault) }
    }

    /// `f.write_all(bytes)`.
    ///
    /// # Errors
    /// The write's, or `ENOSPC` past the fault's budget (after writing the
    /// bytes that fit).
    pub fn write_all(&self, f: &mut File, bytes: &[u8]) -> io::Result<()> {
        match &self.fault {
            Some(fault) => fault.write_all(f, bytes),
            None => f.write_all(bytes),
        }
    }

    /// `f.set_len(len)`.
    ///
    /// # Errors
    /// The call's, or `EIO` when the fault says so.
    pub fn set_len(&self, f: &File, len: u64) -> io::Result<()> {
        if let Some(fault) = &self.fault {
            fault.check_set_len()?;
        }
        f.set_len(len)
    }
}

#[derive(Debug)]
pub struct Fault {
    /// Bytes that may still be written; `u64::MAX`: no limit.
    budget: AtomicU64,
    /// `set_len` fails with `EIO` (the cut-back after a failed write fails too).
    fail_set_len: AtomicBool,
    /// Writes that were cut short or refused.
    pub failures: AtomicU64,
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
    pub fn fill_after(&self, bytes: u64) {
        self.budget.store(bytes, SeqCst);
    }

    /// Space is back.
    pub fn free(&self) {
        self.budget.store(u64::MAX, SeqCst);
    }

    pub fn set_len_fails(&self, on: bool) {
        self.fail_set_len.store(on, SeqCst);
    }

    fn check_set_len(&self) -> io::Result<()> {
        if self.fail_set_len.load(SeqCst) {
            return Err(io::Error::from_raw_os_error(EIO));
        }
        Ok(())
    }

    /// `f.write_all(bytes)` on a disk with the remaining budget.
    fn write_all(&self, f: &mut File, bytes: &[u8]) -> io::Result<()> {
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
