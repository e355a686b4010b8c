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
        let epochs = self.epochs_overlapping(min_ms, max_ms);
        let mut plan = ReadPlan::default();
        for key in keys {
            let mut missing: Vec<usize> = Vec::new();
            let mut chosen: BTreeSet<usize> = BTreeSet::new();
            for &e in &epochs {
                let owners = self.owners_in(e, key);
                // A node already chosen for this key (an earlier epoch) serves again.
                if owners.iter().any(|o| chosen.contains(o)) {
                    continue;
                }
                let pick = prefer
                    .filter(|p| owners.contains(p) && usable(*p))
                    .or_else(|| owners.iter().copied().find(|&o| usable(o)));
                match pick {
                    Some(n) => {
                        chosen.insert(n);
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
