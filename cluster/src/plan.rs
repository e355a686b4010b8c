//! Read planning: which node to ask for which shards.

use std::collections::{BTreeMap, BTreeSet};

use super::{ShardKey, ShardMap};

/// One replica per shard and epoch of the range.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    /// Node index -> the shards to read from it.
    pub assignments: BTreeMap<usize, BTreeSet<ShardKey>>,
    /// Shards none of whose owners, in some epoch of the range, may be asked.
    pub missing: Vec<MissingShard>,
}

/// A shard the answer will lack, and the owners that could not be asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingShard {
    pub key: ShardKey,
    pub owners: Vec<usize>,
}

/// Which owner of a shard a read asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefer {
    /// The owner first in rendezvous rank.
    Rank,
    /// This node (the asking one) where it owns the shard, else by rank: a
    /// read that moves raw samples moves the fewest bytes so.
    Node(usize),
    /// The owner asked for the fewest shards of this read so far, ties by
    /// rank: a read whose answers are small (aggregates computed by each
    /// owner) spreads its work over the owners. With a replication factor
    /// of 2 on three nodes, preferring the asking node gave it two thirds of
    /// the shards and each peer a sixth (`perf`, 2026-12-07).
    Balance,
}

impl ShardMap {
    /// Plans a read of `keys` over `[min_ms, max_ms]`: for every epoch the
    /// range overlaps, one owner of each key that `usable` allows, `prefer`
    /// (the asking node) first, then by rendezvous rank. A key owned by
    /// different nodes in two epochs is read from one of each; the caller
    /// merges the answers and drops repeated samples.
    pub fn plan_read<'a>(
        &self,
        keys: impl IntoIterator<Item = &'a ShardKey>,
        min_ms: i64,
        max_ms: i64,
        usable: impl Fn(usize) -> bool,
        prefer: Option<usize>,
    ) -> ReadPlan {
        let prefer = prefer.map_or(Prefer::Rank, Prefer::Node);
        self.plan_read_by(keys, min_ms, max_ms, usable, prefer)
    }

    /// [`Self::plan_read`], choosing among a key's usable owners by `prefer`.
    pub fn plan_read_by<'a>(
        &self,
        keys: impl IntoIterator<Item = &'a ShardKey>,
        min_ms: i64,
        max_ms: i64,
        usable: impl Fn(usize) -> bool,
        prefer: Prefer,
    ) -> ReadPlan {
        let epochs = self.epochs_overlapping(min_ms, max_ms);
        let mut plan = ReadPlan::default();
        // Node -> shards (of either epoch) it is asked for so far.
        let mut load: BTreeMap<usize, usize> = BTreeMap::new();
        for key in keys {
            let mut missing: Vec<usize> = Vec::new();
            let mut chosen: BTreeSet<usize> = BTreeSet::new();
            for &e in &epochs {
                let owners = self.owners_in(e, key);
                // A node already chosen for this key (an earlier epoch) serves again.
                if owners.iter().any(|o| chosen.contains(o)) {
                    continue;
                }
                let mut candidates = owners.iter().copied().filter(|&o| usable(o));
                let pick = match prefer {
                    Prefer::Rank => candidates.next(),
                    Prefer::Node(p) => Some(p)
                        .filter(|p| owners.contains(p) && usable(*p))
                        .or_else(|| candidates.next()),
                    // The first of the least loaded: ties by rank.
                    Prefer::Balance => candidates.min_by_key(|o| load.get(o).copied().unwrap_or(0)),
                };
                match pick {
                    Some(n) => {
                        chosen.insert(n);
                        *load.entry(n).or_default() += 1;
                    }
                    None => {
                        for o in owners {
                            if !missing.contains(&o) {
                                missing.push(o);
                            }
                        }
                    }
                }
            }
            for n in chosen {
                plan.assignments.entry(n).or_default().insert(key.clone());
            }
            if !missing.is_empty() {
                plan.missing.push(MissingShard {
                    key: key.clone(),
                    owners: missing,
                });
            }
        }
        plan
    }
}
