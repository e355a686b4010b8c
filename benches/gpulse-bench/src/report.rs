//! `gpulse-bench report`: the results of a comparison run as tables of
//! ratios against gpulse, a Markdown section for docs/BENCHMARKS.md, and PNG
//! charts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};
use serde_json::Value;

use super::{IngestResult, QueryResult, ReportArgs};

const BEGIN: &str = "<!-- peers:begin -->";
const END: &str = "<!-- peers:end -->";
/// The peer the targets are stated against.
const VM: &str = "victoria-metrics";

#[derive(Debug, Default)]
struct Results {
    ingest: Vec<IngestResult>,
    queries: Vec<QueryResult>,
}

fn read(paths: &[std::path::PathBuf]) -> anyhow::Result<Results> {
    let mut r = Results::default();
    for path in paths {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let at = || format!("{}:{}", path.display(), n + 1);
            let v: Value = serde_json::from_str(line).with_context(at)?;
            match v["kind"].as_str() {
                Some("ingest") => r.ingest.push(serde_json::from_value(v).with_context(at)?),
                Some("query") => r.queries.push(serde_json::from_value(v).with_context(at)?),
                other => bail!("{}: unknown result kind {other:?}", at()),
            }
        }
    }
    if r.ingest.is_empty() && r.queries.is_empty() {
        bail!("no results in {paths:?}");
    }
    Ok(r)
}

pub(super) fn run(args: &ReportArgs) -> anyhow::Result<()> {
    let results = read(&args.results)?;
    let targets = targets(&results);
    let mut out = String::new();
    render_targets(&mut out, &targets);
    render_ingest(&mut out, &results.ingest);
    render_queries(&mut out, &results.queries);
    #[allow(clippy::print_stdout)] // the report is the command's output
    {
        println!("{out}");
    }
    let mut charts = Vec::new();
    if let Some(dir) = &args.charts {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        charts = charts::draw(dir, &results)?;
    }
    if let Some(md) = &args.markdown {
        let mut section = format!("{BEGIN}\n");
        if let Some(note) = &args.note {
            let _ = writeln!(section, "{note}\n");
        }
        section.push_str(&out);
        for (file, title) in &charts {
            let _ = writeln!(section, "![{title}]({}/{file})\n", args.charts_link);
        }
        section.push_str(END);
        splice(md, &section)?;
    }
    Ok(())
}

/// Replaces the marked section of `path`, or appends one.
fn splice(path: &Path, section: &str) -> anyhow::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(b), Some(e)) if b < e => format!("{}{section}{}", &old[..b], &old[e + END.len()..]),
        (None, None) => format!("{}\n{section}\n", old.trim_end()),
        _ => bail!(
            "{}: the {BEGIN} / {END} markers are unbalanced",
            path.display()
        ),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0} k", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), fmt_num)
}

/// A target of issue #7: gpulse's figure against VictoriaMetrics's.
#[derive(Debug)]
struct Target {
    what: String,
    gpulse: Option<f64>,
    peer: Option<f64>,
    /// `gpulse / peer` must be at least (`true`) or at most this.
    bound: f64,
    at_least: bool,
}

impl Target {
    fn ratio(&self) -> Option<f64> {
        Some(self.gpulse? / self.peer?).filter(|r| r.is_finite())
    }

    fn met(&self) -> Option<bool> {
        let r = self.ratio()?;
        Some(if self.at_least {
            r >= self.bound
        } else {
            r <= self.bound
        })
    }
}

fn find<'a>(
    r: &'a [IngestResult],
    system: &str,
    protocol: &str,
    dataset: &str,
) -> Option<&'a IngestResult> {
    r.iter()
        .rev()
        .find(|x| x.system == system && x.protocol == protocol && x.dataset == dataset)
}

fn targets(r: &Results) -> Vec<Target> {
    let mut t = Vec::new();
    let sim = "simulated";
    let vm = find(&r.ingest, VM, "remote-write", sim);
    let g_agent = find(&r.ingest, "gpulse", "agent", sim);
    let g_rw = find(&r.ingest, "gpulse", "remote-write", sim);
    t.push(Target {
        what: "ingest samples/s per server core: gpulse agent protocol ÷ VM remote-write".into(),
        gpulse: g_agent.and_then(|x| x.samples_per_core_s),
        peer: vm.and_then(|x| x.samples_per_core_s),
        bound: 3.0,
        at_least: true,
    });
    t.push(Target {
        what: "ingest samples/s (wall): gpulse remote-write ÷ VM remote-write".into(),
        gpulse: g_rw.map(|x| x.samples_per_s),
        peer: vm.map(|x| x.samples_per_s),
        bound: 1.0,
        at_least: true,
    });
    for dataset in ["simulated", "recorded"] {
        let vm = find(&r.ingest, VM, "remote-write", dataset);
        let g = find(&r.ingest, "gpulse", "agent", dataset)
            .or_else(|| find(&r.ingest, "gpulse", "remote-write", dataset));
        t.push(Target {
            what: format!("bytes per sample on disk, {dataset} data, index included: gpulse ÷ VM"),
            gpulse: g.and_then(|x| x.bytes_per_sample),
            peer: vm.and_then(|x| x.bytes_per_sample),
            bound: 0.75,
            at_least: false,
        });
    }
    t.push(Target {
        what: "server RSS per active series: gpulse ÷ VM".into(),
        gpulse: g_agent.and_then(|x| x.rss_per_series),
        peer: vm.and_then(|x| x.rss_per_series),
        bound: 1.0,
        at_least: false,
    });
    let p50 = |system: &str, query: &str| {
        r.queries
            .iter()
            .rev()
            .find(|q| q.system == system && q.query == query && q.language == "promql")
            .and_then(|q| q.p50_ms)
    };
    let mut names: Vec<&str> = Vec::new();
    for q in &r.queries {
        if !names.contains(&q.query.as_str()) {
            names.push(&q.query);
        }
    }
    for q in names {
        if p50(VM, q).is_some() || p50("gpulse", q).is_some() {
            t.push(Target {
                what: format!("PromQL p50 `{q}`: gpulse ÷ VM"),
                gpulse: p50("gpulse", q),
                peer: p50(VM, q),
                bound: 1.0,
                at_least: false,
            });
        }
    }
    t
}

fn render_targets(out: &mut String, targets: &[Target]) {
    let _ = writeln!(out, "### Targets (issue #7), against VictoriaMetrics\n");
    let _ = writeln!(
        out,
        "| target | gpulse | VictoriaMetrics | ratio | goal | met |"
    );
    let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- |");
    for t in targets {
        let goal = format!("{} {}", if t.at_least { "≥" } else { "≤" }, t.bound);
        let met = match t.met() {
            Some(true) => "**yes**",
            Some(false) => "**no**",
            None => "not measured",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {goal} | {met} |",
            t.what,
            opt(t.gpulse),
            opt(t.peer),
            t.ratio().map_or_else(|| "-".into(), |r| format!("{r:.2}×")),
        );
    }
    out.push('\n');
}

fn render_ingest(out: &mut String, rows: &[IngestResult]) {
    let mut datasets: Vec<&str> = rows.iter().map(|r| r.dataset.as_str()).collect();
    datasets.sort_unstable();
    datasets.dedup();
    for dataset in datasets {
        let base = find(rows, "gpulse", "agent", dataset);
        let _ = writeln!(out, "### Ingest, {dataset} data\n");
        let _ = writeln!(
            out,
            "| system | protocol | samples | series | samples/s | samples/s per server core | CPU-s per M samples | peak RSS (MiB) | RSS per series (B) | ack p50 / p99 (ms) | bytes on disk per sample | per core vs gpulse agent |"
        );
        let _ = writeln!(
            out,
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        );
        for r in rows.iter().filter(|r| r.dataset == dataset) {
            let vs = match (
                base.and_then(|b| b.samples_per_core_s),
                r.samples_per_core_s,
            ) {
                (Some(b), Some(x)) if x > 0.0 => format!("{:.2}× slower", b / x),
                _ => "-".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} / {:.1} | {} | {} |",
                r.system,
                r.protocol,
                fmt_num(r.samples_acked as f64),
                r.series,
                fmt_num(r.samples_per_s),
                opt(r.samples_per_core_s),
                opt(r.cpu_s_per_million),
                opt(r.rss_peak_bytes.map(|b| b as f64 / 1048576.0)),
                opt(r.rss_per_series),
                r.ack_p50_ms,
                r.ack_p99_ms,
                opt(r.bytes_per_sample),
                if std::ptr::eq(r, base.map_or(std::ptr::null(), |b| b as *const _)) {
                    "1.00×".into()
                } else {
                    vs
                },
            );
            if r.samples_acked < r.samples_sent {
                let _ = writeln!(
                    out,
                    "| ↳ {} of {} samples not acked: {} | | | | | | | | | | | |",
                    r.samples_sent - r.samples_acked,
                    r.samples_sent,
                    r.first_error.as_deref().unwrap_or("").replace('|', "/")
                );
            }
        }
        out.push('\n');
    }
}

fn render_queries(out: &mut String, rows: &[QueryResult]) {
    if rows.is_empty() {
        return;
    }
    let mut columns: Vec<(String, String)> = Vec::new();
    let mut cells: BTreeMap<(String, (String, String)), String> = BTreeMap::new();
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        let col = (r.system.clone(), r.language.clone());
        if !columns.contains(&col) {
            columns.push(col.clone());
        }
        if !names.contains(&r.query) {
            names.push(r.query.clone());
        }
        let cell = match (&r.error, r.p50_ms, r.p99_ms) {
            (Some(e), _, _) => format!(
                "failed: {}",
                e.replace('|', "/").chars().take(80).collect::<String>()
            ),
            (None, Some(p50), Some(p99)) => format!("{p50:.2} / {p99:.2}"),
            _ => "-".into(),
        };
        cells.insert((r.query.clone(), col), cell);
    }
    let _ = writeln!(out, "### Query latency, p50 / p99 (ms)\n");
    let mut header = "| query |".to_string();
    let mut rule = "| --- |".to_string();
    for (system, language) in &columns {
        let _ = write!(header, " {system} {language} |");
        rule.push_str(" --- |");
    }
    let _ = writeln!(out, "{header}\n{rule}");
    for q in &names {
        let mut line = format!("| `{q}` |");
        for c in &columns {
            let _ = write!(
                line,
                " {} |",
                cells
                    .get(&(q.clone(), c.clone()))
                    .map_or("-", String::as_str)
            );
        }
        let _ = writeln!(out, "{line}");
    }
    out.push('\n');
}

mod charts {
    use std::path::Path;

    use anyhow::{Context, anyhow};
    use plotters::prelude::*;

    use super::Results;

    const FONTS: [&str; 3] = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ];

    fn register_font() -> anyhow::Result<()> {
        let path = FONTS
            .iter()
            .find(|p| Path::new(p).exists())
            .ok_or_else(|| anyhow!("no DejaVu Sans font for the chart labels (apt-get install fonts-dejavu-core); looked in {FONTS:?}"))?;
        let bytes = std::fs::read(path).with_context(|| format!("reading {path}"))?;
        // plotters keeps fonts for the life of the process.
        plotters::style::register_font("sans-serif", FontStyle::Normal, Vec::leak(bytes))
            .map_err(|_| anyhow!("{path} is not a font plotters can read"))
    }

    /// Writes the charts; returns `(file name, title)` of each.
    pub(super) fn draw(dir: &Path, r: &Results) -> anyhow::Result<Vec<(String, String)>> {
        register_font()?;
        let mut out = Vec::new();

        let label = |s: &str, p: &str| format!("{s} ({p})");
        let mut systems: Vec<(String, String)> = r
            .ingest
            .iter()
            .map(|x| (x.system.clone(), x.protocol.clone()))
            .collect();
        systems.sort();
        systems.dedup();
        let sim: Vec<(String, Option<f64>)> = systems
            .iter()
            .map(|(s, p)| {
                let v =
                    super::find(&r.ingest, s, p, "simulated").and_then(|x| x.samples_per_core_s);
                (label(s, p), v.map(|v| v / 1e6))
            })
            .collect();
        let title = "Ingest: million samples/s per server core (simulated fleet)";
        bars(
            &dir.join("ingest_per_core.png"),
            title,
            &[String::new()],
            &sim,
            false,
        )?;
        out.push(("ingest_per_core.png".into(), title.into()));

        let datasets = ["simulated".to_string(), "recorded".to_string()];
        let bytes: Vec<(String, Vec<Option<f64>>)> = systems
            .iter()
            .map(|(s, p)| {
                let v = datasets
                    .iter()
                    .map(|d| super::find(&r.ingest, s, p, d).and_then(|x| x.bytes_per_sample))
                    .collect();
                (label(s, p), v)
            })
            .collect();
        let title = "Bytes on disk per sample, index included";
        grouped(
            &dir.join("bytes_per_sample.png"),
            title,
            &datasets,
            &bytes,
            false,
        )?;
        out.push(("bytes_per_sample.png".into(), title.into()));

        if !r.queries.is_empty() {
            let (mut names, mut cols) = (Vec::<String>::new(), Vec::<(String, String)>::new());
            for q in &r.queries {
                if !names.contains(&q.query) {
                    names.push(q.query.clone());
                }
                let col = (q.system.clone(), q.language.clone());
                if !cols.contains(&col) {
                    cols.push(col);
                }
            }
            let lat: Vec<(String, Vec<Option<f64>>)> = cols
                .iter()
                .map(|(s, l)| {
                    let v = names
                        .iter()
                        .map(|n| {
                            r.queries
                                .iter()
                                .rev()
                                .find(|q| &q.system == s && &q.language == l && &q.query == n)
                                .and_then(|q| q.p50_ms)
                        })
                        .collect();
                    (format!("{s} {l}"), v)
                })
                .collect();
            let title = "Query latency p50 (ms, log scale)";
            grouped(&dir.join("query_p50.png"), title, &names, &lat, true)?;
            out.push(("query_p50.png".into(), title.into()));
        }
        Ok(out)
    }

    fn bars(
        path: &Path,
        title: &str,
        groups: &[String],
        bars: &[(String, Option<f64>)],
        log: bool,
    ) -> anyhow::Result<()> {
        let series: Vec<(String, Vec<Option<f64>>)> =
            bars.iter().map(|(n, v)| (n.clone(), vec![*v])).collect();
        grouped(path, title, groups, &series, log)
    }

    /// Groups along x, one bar per series in each group.
    fn grouped(
        path: &Path,
        title: &str,
        groups: &[String],
        series: &[(String, Vec<Option<f64>>)],
        log: bool,
    ) -> anyhow::Result<()> {
        let e = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
        let max = series
            .iter()
            .flat_map(|(_, v)| v.iter().flatten())
            .fold(0.0f64, |m, &v| m.max(v));
        let min = series
            .iter()
            .flat_map(|(_, v)| v.iter().flatten())
            .fold(f64::INFINITY, |m, &v| m.min(v));
        let root = BitMapBackend::new(path, (1200, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let n = series.len().max(1) as f64;
        let x_range = 0f64..groups.len().max(1) as f64;
        let palette = [
            RGBColor(0x1f, 0x77, 0xb4),
            RGBColor(0xff, 0x7f, 0x0e),
            RGBColor(0x2c, 0xa0, 0x2c),
            RGBColor(0xd6, 0x27, 0x28),
            RGBColor(0x94, 0x67, 0xbd),
            RGBColor(0x8c, 0x56, 0x4b),
            RGBColor(0xe3, 0x77, 0xc2),
            RGBColor(0x7f, 0x7f, 0x7f),
        ];
        macro_rules! draw {
            ($chart:expr, $base:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .disable_x_mesh()
                    .x_label_formatter(&|_| String::new())
                    .label_style(("sans-serif", 15))
                    .draw()
                    .map_err(|x| e(&x))?;
                // Group names under the middle of each group.
                let style = TextStyle::from(("sans-serif", 14)).pos(
                    plotters::style::text_anchor::Pos::new(
                        plotters::style::text_anchor::HPos::Center,
                        plotters::style::text_anchor::VPos::Top,
                    ),
                );
                for (g, name) in groups.iter().enumerate() {
                    let (px, py) = chart.backend_coord(&(g as f64 + 0.5, $base));
                    root.draw(&Text::new(name.clone(), (px, py + 8), style.clone()))
                        .map_err(|x| e(&x))?;
                }
                for (k, (name, values)) in series.iter().enumerate() {
                    let color = palette[k % palette.len()];
                    let bars = values.iter().enumerate().filter_map(|(g, v)| {
                        let v = (*v)?;
                        let x0 = g as f64 + 0.1 + 0.8 * k as f64 / n;
                        let x1 = x0 + 0.8 / n;
                        Some(Rectangle::new([(x0, $base), (x1, v)], color.filled()))
                    });
                    chart
                        .draw_series(bars)
                        .map_err(|x| e(&x))?
                        .label(name.clone())
                        .legend(move |(x, y)| {
                            Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                        });
                }
                chart
                    .configure_series_labels()
                    .background_style(WHITE.mix(0.9))
                    .border_style(BLACK)
                    .label_font(("sans-serif", 15))
                    .position(SeriesLabelPosition::UpperRight)
                    .draw()
                    .map_err(|x| e(&x))?;
            }};
        }
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70);
        if log {
            let lo = if min.is_finite() {
                (min / 2.0).max(1e-3)
            } else {
                0.1
            };
            let chart = builder
                .build_cartesian_2d(x_range, (lo..(max * 40.0).max(lo * 10.0)).log_scale())
                .map_err(|x| e(&x))?;
            draw!(chart, lo);
        } else {
            let chart = builder
                .build_cartesian_2d(x_range, 0f64..(max * 1.6).max(1e-9))
                .map_err(|x| e(&x))?;
            draw!(chart, 0.0);
        }
        root.present().map_err(|x| e(&x))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ingest(system: &str, protocol: &str, dataset: &str, per_core: f64, bps: f64) -> String {
        serde_json::json!({
            "kind": "ingest", "system": system, "protocol": protocol, "dataset": dataset,
            "hosts": 2, "series": 100, "samples_sent": 1000, "samples_acked": 1000,
            "samples_dropped": 0, "samples_rejected": 0, "requests": 4, "errors": 0,
            "first_error": null, "wall_s": 1.0, "samples_per_s": per_core / 2.0,
            "server_cpu_s": 1.0, "samples_per_core_s": per_core, "cpu_s_per_million": 1e6 / per_core,
            "rss_end_bytes": 1000000, "rss_peak_bytes": 2000000, "rss_per_series": 10000.0,
            "ack_p50_ms": 1.0, "ack_p99_ms": 2.0, "flush_s": 0.5, "disk_bytes": 900,
            "bytes_per_sample": bps, "end_ms": 0
        })
        .to_string()
    }

    #[test]
    fn targets_compare_gpulse_with_victoria_metrics_and_the_section_is_spliced() {
        let dir = tempfile::tempdir().unwrap();
        let results = dir.path().join("r.jsonl");
        let q = |system: &str, p50: f64| {
            serde_json::json!({"kind": "query", "system": system, "query": "top10_hottest",
                "language": "promql", "reps": 3, "p50_ms": p50, "p99_ms": p50 * 2.0,
                "results": 10, "error": null})
            .to_string()
        };
        let lines = [
            ingest("gpulse", "agent", "simulated", 3_000_000.0, 0.6),
            ingest("gpulse", "remote-write", "simulated", 1_000_000.0, 0.6),
            ingest(VM, "remote-write", "simulated", 1_200_000.0, 1.0),
            ingest("gpulse", "agent", "recorded", 2_000_000.0, 1.2),
            ingest(VM, "remote-write", "recorded", 1_000_000.0, 1.0),
            q("gpulse", 2.0),
            q(VM, 4.0),
        ];
        std::fs::write(&results, lines.join("\n")).unwrap();
        let r = read(std::slice::from_ref(&results)).unwrap();
        let t = targets(&r);
        let by = |what: &str| t.iter().find(|t| t.what.contains(what)).unwrap();
        let per_core = by("per server core");
        assert_eq!(per_core.ratio(), Some(2.5));
        assert_eq!(per_core.met(), Some(false), "2.5× is short of 3×");
        assert_eq!(by("simulated data").met(), Some(true), "0.6 ≤ 0.75");
        assert_eq!(by("recorded data").met(), Some(false), "1.2 > 0.75");
        assert_eq!(by("top10_hottest").ratio(), Some(0.5));

        let md = dir.path().join("B.md");
        std::fs::write(&md, format!("# B\n\nbefore\n{BEGIN}\nold\n{END}\nafter\n")).unwrap();
        run(&ReportArgs {
            results: vec![results],
            markdown: Some(md.clone()),
            charts: Some(dir.path().join("charts")),
            charts_link: "bench".into(),
            note: Some("Run on a test.".into()),
        })
        .unwrap();
        let text = std::fs::read_to_string(&md).unwrap();
        assert!(text.starts_with("# B\n\nbefore\n<!-- peers:begin -->\nRun on a test."));
        assert!(text.ends_with("<!-- peers:end -->\nafter\n"), "{text}");
        assert!(!text.contains("\nold\n"));
        assert!(text.contains("| 2.50× | ≥ 3 | **no** |"), "{text}");
        for png in [
            "ingest_per_core.png",
            "bytes_per_sample.png",
            "query_p50.png",
        ] {
            let bytes = std::fs::read(dir.path().join("charts").join(png)).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png}");
            assert!(text.contains(&format!("(bench/{png})")));
        }
    }
}
