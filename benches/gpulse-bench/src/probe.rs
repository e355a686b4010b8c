//! What the benchmark reads about the server under test from `/proc` and
//! its data directory: CPU time, resident memory, bytes on disk.

use std::path::Path;

/// `/proc/PID/stat` counts CPU time in clock ticks of `USER_HZ`, which Linux
/// fixes at 100 per second for user space on every architecture it exposes
/// it on (the kernel's own HZ may differ; the ABI value does not).
const USER_HZ: f64 = 100.0;

/// A running process measured by its `/proc` entries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Probe {
    pub(crate) pid: u32,
}

impl Probe {
    /// CPU seconds (user + system, all threads) used so far, or `None` when
    /// the process is gone or `/proc` is not there.
    pub(crate) fn cpu_seconds(&self) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).ok()?;
        parse_stat_cpu(&stat)
    }

    /// `(VmRSS, VmHWM)`: resident bytes now and at the peak.
    pub(crate) fn rss_bytes(&self) -> Option<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        Some((
            status_kib(&status, "VmRSS:")? * 1024,
            status_kib(&status, "VmHWM:")? * 1024,
        ))
    }
}

/// utime + stime in seconds. The command name (field 2) is in parentheses
/// and may hold spaces, so fields are counted after the last `)`.
fn parse_stat_cpu(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    // After the name: state(3) ppid(4) ... utime is field 14, stime 15.
    let utime: f64 = f.nth(11)?.parse().ok()?;
    let stime: f64 = f.next()?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

fn status_kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// Bytes of all regular files under `path` (their length, not the blocks
/// they occupy: a preallocated or sparse file counts at its length).
pub(crate) fn dir_bytes(path: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                total += meta.len();
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        // A name with a space and a parenthesis; utime 250, stime 50 ticks.
        let stat =
            "4242 (gp (x) ulse) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 1 2 3";
        assert_eq!(parse_stat_cpu(stat), Some(3.0));
        assert_eq!(parse_stat_cpu("garbage"), None);
    }

    #[test]
    fn this_process_is_measurable() {
        let p = Probe {
            pid: std::process::id(),
        };
        let (rss, peak) = p.rss_bytes().expect("a /proc on Linux");
        assert!(rss > 0 && peak >= rss, "{rss} {peak}");
        assert!(p.cpu_seconds().is_some());
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("a")).unwrap();
        std::fs::write(dir.path().join("a/x"), [0u8; 1000]).unwrap();
        std::fs::write(dir.path().join("y"), [0u8; 24]).unwrap();
        assert_eq!(dir_bytes(dir.path()).unwrap(), 1024);
    }
}
