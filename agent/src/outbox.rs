//! Every batch the agent made and ingest has not acked: the newest in a
//! bounded memory buffer, older ones in the disk spool, in one sequence order.
//!
//! New batches always go to memory. When memory holds more than its bound,
//! the oldest batches move to the spool; when the spool is full it drops its
//! oldest file. Without a spool, the oldest batches in memory are dropped.
//! Either way the drop is counted (`gpulse_agent_samples_dropped_total`).

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use gpulse_proto::v1::SeriesDef;
use tracing::{error, warn};

use crate::metrics::AgentMetrics;
use crate::spool::{Dropped, Opened, Pending, Spool};

/// Where unacked batches live.
#[derive(Debug, Clone)]
pub struct BufferConfig {
    /// Samples held in memory before the oldest batches move to the spool.
    /// Default 131,072 (about 10 min of 8 GPUs at 1 Hz, 2.6 MiB).
    pub memory_samples: usize,
    /// The spool directory; `None` keeps everything in memory, so unacked
    /// batches do not survive a restart. Default `None` (the binary sets one).
    pub spool_dir: Option<PathBuf>,
    /// Most bytes the spool holds. Default 1 GiB.
    pub spool_max_bytes: u64,
    /// Size at which a spool file is closed and the next begun. Default 8 MiB.
    pub spool_file_bytes: u64,
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self {
            memory_samples: 131_072,
            spool_dir: None,
            spool_max_bytes: 1 << 30,
            spool_file_bytes: 8 << 20,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Outbox {
    epoch: u64,
    next_seq: u64,
    mem: BTreeMap<u64, Pending>,
    mem_samples: usize,
    max_mem_samples: usize,
    spool: Option<Spool>,
    metrics: Arc<AgentMetrics>,
}

impl Outbox {
    /// Opens the spool (if configured) and takes over what it holds.
    pub(crate) fn open(
        config: &BufferConfig,
        metrics: Arc<AgentMetrics>,
        intern: impl FnMut(&SeriesDef) -> u32,
    ) -> io::Result<Self> {
        let (spool, epoch, next_seq) = match &config.spool_dir {
            Some(dir) => {
                let Opened {
                    spool,
                    epoch,
                    next_seq,
                } = Spool::open(dir, config.spool_max_bytes, config.spool_file_bytes, intern)?;
                metrics
                    .spool_damaged_records
                    .fetch_add(spool.damaged, Relaxed);
                (Some(spool), epoch, next_seq)
            }
            None => (None, random_epoch(), 1),
        };
        let outbox = Self {
            epoch,
            next_seq,
            mem: BTreeMap::new(),
            mem_samples: 0,
            max_mem_samples: config.memory_samples.max(1),
            spool,
            metrics,
        };
        outbox.publish();
        Ok(outbox)
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Takes a new batch; returns its seq. May move older batches to the
    /// spool, or drop the oldest when everything is full.
    pub(crate) fn push(
        &mut self,
        ids: Vec<u32>,
        ts_ms: Vec<i64>,
        values: Vec<f64>,
        defs: &[SeriesDef],
    ) -> u64 {
        let seq = self.next_seq;
        if let Some(spool) = &mut self.spool
            && let Err(e) = spool.reserve(seq)
        {
            // Without a persisted reservation a crash could re-use this seq;
            // go on (the data matters more) and say so.
            error!(error = %e, "could not persist the spool's sequence reservation");
        }
        self.next_seq += 1;
        self.mem_samples += ids.len();
        self.mem.insert(
            seq,
            Pending {
                epoch: self.epoch,
                ids,
                ts_ms,
                values,
            },
        );
        while self.mem_samples > self.max_mem_samples && self.mem.len() > 1 {
            let (old, p) = self.mem.pop_first().expect("BUG: len > 1");
            self.mem_samples -= p.samples();
            self.evict(old, &p, defs);
        }
        self.publish();
        seq
    }

    /// Moves batch `seq` to the spool, or drops it when there is none.
    fn evict(&mut self, seq: u64, p: &Pending, defs: &[SeriesDef]) {
        let dropped = match &mut self.spool {
            Some(spool) => match spool.append(seq, p, defs) {
                Ok(d) => d,
                Err(e) => {
                    error!(seq, error = %e, "spool write failed; dropping the batch");
                    Dropped {
                        batches: 1,
                        samples: p.samples() as u64,
                    }
                }
            },
            None => Dropped {
                batches: 1,
                samples: p.samples() as u64,
            },
        };
        if dropped.batches > 0 {
            let m = &self.metrics;
            let total = m.samples_dropped.fetch_add(dropped.samples, Relaxed) + dropped.samples;
            m.batches_dropped.fetch_add(dropped.batches, Relaxed);
            warn!(
                batches = dropped.batches,
                samples = dropped.samples,
                dropped_total = total,
                "buffer full: dropped the oldest unacked samples"
            );
        }
    }

    /// The first unacked batch at or after `seq`.
    pub(crate) fn next_from(&self, seq: u64) -> Option<u64> {
        let spooled = self.spool.as_ref().and_then(|s| s.first_at_or_after(seq));
        let mem = self.mem.range(seq..).next().map(|(&s, _)| s);
        match (spooled, mem) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Batch `seq`, from memory or the spool. A spooled batch that cannot be
    /// read back is logged, counted as dropped and forgotten.
    pub(crate) fn get(&mut self, seq: u64) -> Option<Pending> {
        if let Some(p) = self.mem.get(&seq) {
            return Some(p.clone());
        }
        let spool = self.spool.as_mut()?;
        match spool.read(seq) {
            Ok(p) => p,
            Err(e) => {
                error!(seq, error = %e, "cannot read a spooled batch back; dropping it");
                spool.ack(seq);
                self.metrics.batches_dropped.fetch_add(1, Relaxed);
                self.publish();
                None
            }
        }
    }

    /// Forgets an acked (or rejected) batch. Returns whether it was held.
    pub(crate) fn ack(&mut self, seq: u64) -> bool {
        let held = if let Some(p) = self.mem.remove(&seq) {
            self.mem_samples -= p.samples();
            true
        } else {
            self.spool.as_mut().is_some_and(|s| s.ack(seq))
        };
        self.publish();
        held
    }

    pub(crate) fn len(&self) -> usize {
        self.mem.len() + self.spool.as_ref().map_or(0, |s| s.batches())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// At shutdown: moves what memory holds to the spool and makes the spool
    /// durable. Returns the batches that will be lost (no spool).
    pub(crate) fn close(&mut self, defs: &[SeriesDef]) -> usize {
        let Some(spool) = &mut self.spool else {
            return self.mem.len();
        };
        let mut failed = 0;
        for (seq, p) in std::mem::take(&mut self.mem) {
            match spool.append(seq, &p, defs) {
                Ok(d) => failed += d.batches as usize,
                Err(e) => {
                    error!(seq, error = %e, "spool write failed at shutdown; the batch is lost");
                    failed += 1;
                }
            }
        }
        self.mem_samples = 0;
        if let Err(e) = spool.sync() {
            error!(error = %e, "could not sync the spool at shutdown");
        }
        self.publish();
        failed
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.buffer_batches.store(self.mem.len() as u64, Relaxed);
        m.buffer_samples.store(self.mem_samples as u64, Relaxed);
        if let Some(s) = &self.spool {
            m.spool_batches.store(s.batches() as u64, Relaxed);
            m.spool_bytes.store(s.bytes(), Relaxed);
        }
    }
}

fn random_epoch() -> u64 {
    loop {
        let e: u64 = rand::random();
        if e != 0 {
            return e;
        }
    }
}
