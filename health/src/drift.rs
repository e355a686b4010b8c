//! `drift`: a GPU whose driver, VBIOS or InfoROM differs from the fleet's.
//!
//! Mixed drivers cause failures nobody can reproduce (research §2.7): NCCL
//! and CUDA behave differently across versions, and a host left behind by a
//! rolling upgrade is easy to miss among thousands. The signal is not a
//! sample but the inventory each agent sends in its hello (the `gpus`
//! table): the engine is told each GPU's [`Inventory`] and compares it with
//! the fleet's majority at each [`crate::engine::Engine::tick`] after a
//! change, and once a minute.
//!
//! Rules (one warning event per GPU, listing every attribute that differs):
//! - **driver**: differs from the driver that at least
//!   [`DriftConfig::majority`] (2/3) of the GPUs with a known driver run;
//! - **VBIOS** and **InfoROM**: differ from the majority of the GPUs of the
//!   same model (different models ship different VBIOS lines).
//!
//! With no such majority (a rolling upgrade half done, a fleet of two
//! generations) there is no drift to report, and nothing fires. At least
//! [`DriftConfig::min_gpus`] (4) GPUs must be known to speak of a majority.
//! An event clears when the GPU's inventory matches the majority again (the
//! host was upgraded, or the fleet moved to its version). Onset and
//! detection are the time of the tick that saw it: an inventory has no
//! sample time.

use std::collections::HashMap;

use crate::ConfigError;

/// A GPU's static attributes, from the agent's hello (`gpus` table).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Inventory {
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// Driver version, e.g. `550.54.15`; empty when unknown.
    pub driver_version: String,
    /// VBIOS version; empty when unknown.
    pub vbios_version: String,
    /// InfoROM image version; empty when unknown.
    pub inforom_version: String,
}

/// Tunables of the drift rule.
#[derive(Debug, Clone, PartialEq)]
pub struct DriftConfig {
    /// Share of the known GPUs a version needs to be the fleet's.
    pub majority: f64,
    /// Fewest GPUs known (with the attribute, of the model) to judge.
    pub min_gpus: usize,
}

impl Default for DriftConfig {
    fn default() -> Self {
        DriftConfig {
            majority: 2.0 / 3.0,
            min_gpus: 4,
        }
    }
}

impl DriftConfig {
    /// # Errors
    /// A value out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.majority > 0.5 && self.majority <= 1.0) {
            return Err(ConfigError {
                field: "drift.majority",
                reason: "must be in (0.5, 1]",
            });
        }
        if self.min_gpus < 2 {
            return Err(ConfigError {
                field: "drift.min_gpus",
                reason: "must be at least 2",
            });
        }
        Ok(())
    }
}

/// The majority value of one attribute, if there is one.
fn majority<'a>(
    values: impl Iterator<Item = &'a str>,
    config: &DriftConfig,
) -> Option<(&'a str, usize, usize)> {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    let mut known = 0;
    for v in values.filter(|v| !v.is_empty()) {
        *counts.entry(v).or_default() += 1;
        known += 1;
    }
    if known < config.min_gpus {
        return None;
    }
    let (&top, &n) = counts
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
    (n as f64 >= config.majority * known as f64).then_some((top, n, known))
}

/// For each GPU (`None` = inventory unknown), the evidence of its drift, or
/// `None` when it matches the majorities (or there are none).
pub(crate) fn judge(gpus: &[Option<&Inventory>], config: &DriftConfig) -> Vec<Option<String>> {
    let driver = majority(
        gpus.iter().flatten().map(|i| i.driver_version.as_str()),
        config,
    );
    let mut models: HashMap<&str, Vec<&Inventory>> = HashMap::new();
    for i in gpus.iter().flatten() {
        models.entry(i.model.as_str()).or_default().push(i);
    }
    type Majorities<'a> = (
        Option<(&'a str, usize, usize)>,
        Option<(&'a str, usize, usize)>,
    );
    let per_model: HashMap<&str, Majorities> = models
        .iter()
        .map(|(&m, list)| {
            (
                m,
                (
                    majority(list.iter().map(|i| i.vbios_version.as_str()), config),
                    majority(list.iter().map(|i| i.inforom_version.as_str()), config),
                ),
            )
        })
        .collect();
    gpus.iter()
        .map(|g| {
            let g = (*g)?;
            let mut parts = Vec::new();
            let mut check =
                |what: &str, mine: &str, maj: Option<(&str, usize, usize)>, scope: &str| {
                    if let Some((top, n, known)) = maj
                        && !mine.is_empty()
                        && mine != top
                    {
                        parts.push(format!(
                            "{what} {mine}, while {n} of {known} {scope} run {top}"
                        ));
                    }
                };
            check("driver", &g.driver_version, driver, "GPUs of the fleet");
            let (vbios, inforom) = per_model[g.model.as_str()];
            let scope = if g.model.is_empty() {
                "GPUs of unknown model".to_string()
            } else {
                format!("{} GPUs", g.model)
            };
            check("VBIOS", &g.vbios_version, vbios, &scope);
            check("InfoROM", &g.inforom_version, inforom, &scope);
            (!parts.is_empty()).then(|| parts.join("; "))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(driver: &str, vbios: &str) -> Inventory {
        Inventory {
            model: "H100".into(),
            driver_version: driver.into(),
            vbios_version: vbios.into(),
            inforom_version: "G520.0200.00.05".into(),
        }
    }

    #[test]
    fn the_odd_driver_out_is_drift_and_the_rest_are_not() {
        let list: Vec<Inventory> = (0..8)
            .map(|i| {
                inv(
                    if i == 5 { "535.129.03" } else { "550.54.15" },
                    "96.00.89.00.01",
                )
            })
            .collect();
        let refs: Vec<Option<&Inventory>> = list.iter().map(Some).collect();
        let v = judge(&refs, &DriftConfig::default());
        for (i, e) in v.iter().enumerate() {
            assert_eq!(e.is_some(), i == 5, "{i}: {e:?}");
        }
        assert_eq!(
            v[5].as_deref(),
            Some("driver 535.129.03, while 7 of 8 GPUs of the fleet run 550.54.15")
        );
    }

    #[test]
    fn no_majority_no_drift() {
        // A rolling upgrade half done: 5 of 8 is under 2/3.
        let list: Vec<Inventory> = (0..8)
            .map(|i| inv(if i < 3 { "535.129.03" } else { "550.54.15" }, "v"))
            .collect();
        let refs: Vec<Option<&Inventory>> = list.iter().map(Some).collect();
        assert!(
            judge(&refs, &DriftConfig::default())
                .iter()
                .all(Option::is_none)
        );
        // 6 of 8 is over it.
        let list: Vec<Inventory> = (0..8)
            .map(|i| inv(if i < 2 { "535.129.03" } else { "550.54.15" }, "v"))
            .collect();
        let refs: Vec<Option<&Inventory>> = list.iter().map(Some).collect();
        let n = judge(&refs, &DriftConfig::default())
            .iter()
            .flatten()
            .count();
        assert_eq!(n, 2);
        // Three GPUs are too few to speak of a fleet.
        let refs: Vec<Option<&Inventory>> = list[..3].iter().map(Some).collect();
        assert!(
            judge(&refs, &DriftConfig::default())
                .iter()
                .all(Option::is_none)
        );
    }

    #[test]
    fn vbios_is_compared_within_its_model_and_unknowns_are_no_evidence() {
        let mut list: Vec<Inventory> = (0..4).map(|_| inv("550", "96.00")).collect();
        // Four A100s with their own VBIOS line: not drift.
        list.extend((0..4).map(|_| Inventory {
            model: "A100".into(),
            ..inv("550", "92.00")
        }));
        // An H100 with another VBIOS, and one whose driver is unknown.
        list.push(inv("550", "96.11"));
        list.push(inv("", "96.00"));
        let mut refs: Vec<Option<&Inventory>> = list.iter().map(Some).collect();
        refs.push(None);
        let v = judge(&refs, &DriftConfig::default());
        let fired: Vec<usize> = (0..v.len()).filter(|&i| v[i].is_some()).collect();
        assert_eq!(fired, vec![8]);
        assert_eq!(
            v[8].as_deref(),
            Some("VBIOS 96.11, while 5 of 6 H100 GPUs run 96.00")
        );
    }

    #[test]
    fn config_is_validated() {
        assert!(DriftConfig::default().validate().is_ok());
        let bad = DriftConfig {
            majority: 0.5,
            ..DriftConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "drift.majority");
    }
}
