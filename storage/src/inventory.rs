//! The fleet's GPU inventory: one record per GPU ever seen, with its place in
//! the fleet, its static attributes (from the agent's hello) and when it was
//! first and last seen. It answers "which hosts run a driver that differs
//! from the fleet majority" without touching samples.
//!
//! Kept in memory and written to `inventory.ginv` (see
//! `docs/format/inventory.md`) when it changed: at once for a new or changed
//! GPU, and by [`Inventory::persist`] (called by the server's upkeep) for
//! last-seen times. A damaged file is moved to `quarantine/` and the
//! inventory starts empty; it fills again from the next hellos.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tracing::{error, warn};

use crate::error::Error;
use crate::files::{INVENTORY_FILE, QUARANTINE_DIR};

const MAGIC: &[u8; 8] = b"GPLSINV1";
const VERSION: u32 = 1;
/// Magic, version, payload length, crc32c of the payload.
const HEADER_LEN: usize = 20;

/// One GPU, as its agent described it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRecord {
    pub cluster: String,
    pub row: String,
    pub rack: String,
    pub host: String,
    /// NVML index on the host (the `gpu` label).
    pub gpu: String,
    pub uuid: String,
    pub pci_bus_id: String,
    pub model_name: String,
    pub serial: String,
    pub vbios_version: String,
    pub driver_version: String,
    pub inforom_version: String,
    pub cuda_driver_version: String,
    /// `enabled`, `disabled`, or empty when unknown.
    pub mig_mode: String,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
}

impl GpuRecord {
    /// A GPU is identified by its host and UUID (the index when there is
    /// no UUID): a replaced board is a new record.
    fn key(&self) -> (String, String) {
        let id = if self.uuid.is_empty() {
            format!("index:{}", self.gpu)
        } else {
            self.uuid.clone()
        };
        (self.host.clone(), id)
    }

    fn same_attributes(&self, o: &GpuRecord) -> bool {
        let strip = |r: &GpuRecord| GpuRecord {
            first_seen_ms: 0,
            last_seen_ms: 0,
            ..r.clone()
        };
        strip(self) == strip(o)
    }
}

#[derive(Debug, Default)]
struct Inner {
    gpus: BTreeMap<(String, String), GpuRecord>,
    /// Last batch per host, folded into the records by `snapshot` and `persist`.
    host_seen: HashMap<String, i64>,
    dirty: bool,
    /// Bumped when a GPU is added or its attributes change.
    generation: u64,
}

/// See the module docs. Thread-safe.
#[derive(Debug)]
pub struct Inventory {
    path: PathBuf,
    inner: Mutex<Inner>,
}

impl Inventory {
    /// Loads the inventory of `data_dir`, or starts an empty one.
    ///
    /// # Errors
    /// I/O errors other than a missing file.
    pub fn open(data_dir: &Path) -> crate::Result<Self> {
        let path = data_dir.join(INVENTORY_FILE);
        let mut inner = Inner::default();
        match fs::read(&path) {
            Ok(buf) => match decode(&buf) {
                Ok(list) => {
                    for r in list {
                        inner.gpus.insert(r.key(), r);
                    }
                }
                Err(why) => {
                    error!(file = %path.display(), problem = why, "damaged inventory file; moving it to quarantine/ and starting empty");
                    let q = data_dir.join(QUARANTINE_DIR);
                    if fs::create_dir_all(&q)
                        .and_then(|_| fs::rename(&path, q.join(INVENTORY_FILE)))
                        .is_err()
                    {
                        warn!(file = %path.display(), "could not move the damaged inventory to quarantine/");
                    }
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&path, e)),
        }
        Ok(Self {
            path,
            inner: Mutex::new(inner),
        })
    }

    /// Records the GPUs an agent announced at `now_ms`. New or changed GPUs
    /// are written to disk at once.
    pub fn observe(&self, gpus: Vec<GpuRecord>, now_ms: i64) {
        let mut inner = self.inner.lock().expect("BUG: inventory lock poisoned");
        let mut changed = false;
        for mut g in gpus {
            inner.host_seen.insert(g.host.clone(), now_ms);
            match inner.gpus.get_mut(&g.key()) {
                Some(old) if old.same_attributes(&g) => {
                    old.last_seen_ms = old.last_seen_ms.max(now_ms);
                }
                Some(old) => {
                    g.first_seen_ms = old.first_seen_ms;
                    g.last_seen_ms = now_ms;
                    *old = g;
                    changed = true;
                }
                None => {
                    g.first_seen_ms = now_ms;
                    g.last_seen_ms = now_ms;
                    inner.gpus.insert(g.key(), g);
                    changed = true;
                }
            }
        }
        inner.dirty = true;
        if changed {
            inner.generation += 1;
        }
        if changed && let Err(e) = write(&self.path, &mut inner) {
            error!(error = %e, "could not write the inventory; it is retried at the next upkeep");
        }
    }

    /// A batch arrived from `host` at `now_ms`.
    pub fn touch(&self, host: &str, now_ms: i64) {
        let mut inner = self.inner.lock().expect("BUG: inventory lock poisoned");
        match inner.host_seen.get_mut(host) {
            Some(t) => *t = (*t).max(now_ms),
            None => {
                inner.host_seen.insert(host.to_string(), now_ms);
            }
        }
        inner.dirty = true;
    }

    /// A number that changes whenever a GPU is added or changes its
    /// attributes (not when it is merely seen again): readers that derive
    /// something from [`Self::snapshot`] keep it while this stays the same.
    pub fn generation(&self) -> u64 {
        self.inner
            .lock()
            .expect("BUG: inventory lock poisoned")
            .generation
    }

    /// Every GPU, sorted by host and UUID.
    pub fn snapshot(&self) -> Vec<GpuRecord> {
        let mut inner = self.inner.lock().expect("BUG: inventory lock poisoned");
        fold_host_seen(&mut inner);
        inner.gpus.values().cloned().collect()
    }

    /// Writes the inventory if anything changed since the last write.
    ///
    /// # Errors
    /// I/O errors; the inventory stays dirty and is retried.
    pub fn persist(&self) -> crate::Result<()> {
        let mut inner = self.inner.lock().expect("BUG: inventory lock poisoned");
        if !inner.dirty {
            return Ok(());
        }
        write(&self.path, &mut inner)
    }
}

fn fold_host_seen(inner: &mut Inner) {
    let Inner {
        gpus, host_seen, ..
    } = inner;
    for g in gpus.values_mut() {
        if let Some(&t) = host_seen.get(&g.host) {
            g.last_seen_ms = g.last_seen_ms.max(t);
        }
    }
}

fn write(path: &Path, inner: &mut Inner) -> crate::Result<()> {
    fold_host_seen(inner);
    let list: Vec<&GpuRecord> = inner.gpus.values().collect();
    let payload = serde_json::to_vec(&list).expect("BUG: records serialize");
    let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    buf.extend_from_slice(&payload);
    let tmp = path.with_extension("ginv.tmp");
    let mut f = fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    f.write_all(&buf)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    inner.dirty = false;
    Ok(())
}

/// Parses an inventory file; never panics.
pub fn decode(buf: &[u8]) -> Result<Vec<GpuRecord>, &'static str> {
    let header = buf.get(..HEADER_LEN).ok_or("file too short")?;
    if &header[..8] != MAGIC {
        return Err("bad magic number");
    }
    if header[8..12] != VERSION.to_le_bytes() {
        return Err("unknown version");
    }
    let len = u32::from_le_bytes(header[12..16].try_into().expect("BUG: 4 bytes")) as usize;
    let payload = &buf[HEADER_LEN..];
    if payload.len() != len {
        return Err("payload length mismatch");
    }
    if crc32c::crc32c(payload).to_le_bytes() != header[16..20] {
        return Err("checksum mismatch");
    }
    serde_json::from_slice(payload).map_err(|_| "payload does not parse")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(host: &str, index: u32, driver: &str) -> GpuRecord {
        GpuRecord {
            cluster: "c".into(),
            rack: "r1".into(),
            host: host.into(),
            gpu: index.to_string(),
            uuid: format!("GPU-{host}-{index}"),
            driver_version: driver.into(),
            ..GpuRecord::default()
        }
    }

    #[test]
    fn first_and_last_seen_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let inv = Inventory::open(dir.path()).unwrap();
        inv.observe(vec![gpu("h1", 0, "550"), gpu("h1", 1, "550")], 1000);
        inv.touch("h1", 5000);
        // Same attributes: last seen moves, first seen stays.
        inv.observe(vec![gpu("h1", 0, "550")], 7000);
        // A driver upgrade changes the record but keeps first seen.
        inv.observe(vec![gpu("h1", 1, "560")], 8000);
        inv.persist().unwrap();
        drop(inv);

        let inv = Inventory::open(dir.path()).unwrap();
        let s = inv.snapshot();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].first_seen_ms, s[0].last_seen_ms), (1000, 8000));
        assert_eq!((s[1].first_seen_ms, s[1].last_seen_ms), (1000, 8000));
        assert_eq!(s[1].driver_version, "560");
    }

    #[test]
    fn a_damaged_file_is_quarantined_and_never_panics() {
        let dir = tempfile::tempdir().unwrap();
        let inv = Inventory::open(dir.path()).unwrap();
        inv.observe(vec![gpu("h1", 0, "550")], 1000);
        drop(inv);
        let path = dir.path().join(INVENTORY_FILE);
        let good = fs::read(&path).unwrap();
        assert_eq!(decode(&good).unwrap().len(), 1);
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0x20;
            assert!(decode(&b).is_err(), "flip in byte {i}");
        }
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut b = good.clone();
        b[HEADER_LEN + 3] ^= 0x20;
        fs::write(&path, &b).unwrap();
        let inv = Inventory::open(dir.path()).unwrap();
        assert!(inv.snapshot().is_empty());
        assert!(
            dir.path()
                .join(QUARANTINE_DIR)
                .join(INVENTORY_FILE)
                .exists()
        );
    }
}
