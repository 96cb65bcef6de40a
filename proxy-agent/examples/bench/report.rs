//! Statistics and the report: Markdown with tables, SVG plots and JSON.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Value, json};

/// Percentile of sorted nanosecond samples.
pub(crate) fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)] as f64
}

/// Median and spread (min, max) of per-repeat figures.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

pub(crate) fn spread(values: &[f64]) -> Spread {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Spread { median: f64::NAN, min: f64::NAN, max: f64::NAN };
    }
    v.sort_by(f64::total_cmp);
    let median = if v.len() % 2 == 1 { v[v.len() / 2] } else { f64::midpoint(v[v.len() / 2 - 1], v[v.len() / 2]) };
    Spread { median, min: v[0], max: v[v.len() - 1] }
}

impl Spread {
    pub(crate) fn json(&self) -> Value {
        json!({"median": self.median, "min": self.min, "max": self.max})
    }
    pub(crate) fn us(&self) -> String {
        if self.median.is_nan() {
            return "n/a".into();
        }
        format!("{:.1} µs ({:.1}–{:.1})", self.median / 1e3, self.min / 1e3, self.max / 1e3)
    }
}

/// A target from the issue, checked against measured ratios.
pub(crate) struct Target {
    pub name: String,
    pub goal: String,
    pub measured: String,
    pub met: Option<bool>,
}

/// A report section contributed by one measurement module: its Markdown,
/// its JSON (under `key` in report.json), its plots and its targets.
pub(crate) struct Section {
    pub key: &'static str,
    pub markdown: String,
    pub json: Value,
    pub svgs: Vec<(String, String)>,
    pub targets: Vec<Target>,
}

/// A grouped bar chart: one group per x label, one bar per series.
pub(crate) fn svg_bars(title: &str, unit: &str, xs: &[String], series: &[(String, Vec<f64>)]) -> String {
    let (w, h, left, bottom, top) = (760.0, 360.0, 70.0, 60.0, 40.0);
    let max = series.iter().flat_map(|(_, v)| v.iter().copied()).filter(|x| x.is_finite()).fold(0.0f64, f64::max).max(1e-9);
    let colors = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"];
    let plot_w = w - left - 20.0;
    let plot_h = h - bottom - top;
    let group_w = plot_w / xs.len().max(1) as f64;
    let bar_w = group_w * 0.8 / series.len().max(1) as f64;
    let mut s = String::new();
    let _ = write!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#);
    let _ = write!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{title}</text>"#,
        w / 2.0
    );
    for t in 0..=4 {
        let v = max * f64::from(t) / 4.0;
        let y = top + plot_h - plot_h * f64::from(t) / 4.0;
        let _ = write!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{v:.1}</text>"##,
            w - 20.0,
            left - 6.0,
            y + 4.0
        );
    }
    let _ = write!(
        s,
        r#"<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">{unit}</text>"#,
        top + plot_h / 2.0,
        top + plot_h / 2.0
    );
    for (gi, x) in xs.iter().enumerate() {
        let gx = left + group_w * gi as f64 + group_w * 0.1;
        for (si, (_, vals)) in series.iter().enumerate() {
            let v = vals.get(gi).copied().unwrap_or(f64::NAN);
            if !v.is_finite() {
                continue;
            }
            let bh = plot_h * v / max;
            let _ = write!(
                s,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                gx + bar_w * si as f64,
                top + plot_h - bh,
                bar_w * 0.95,
                bh,
                colors[si % colors.len()]
            );
        }
        let _ =
            write!(s, r#"<text x="{:.1}" y="{}" text-anchor="middle">{x}</text>"#, left + group_w * (gi as f64 + 0.5), h - bottom + 18.0);
    }
    for (si, (name, _)) in series.iter().enumerate() {
        let lx = left + 10.0 + 150.0 * si as f64;
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{name}</text>"#,
            h - 22.0,
            colors[si % colors.len()],
            lx + 16.0,
            h - 12.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// "Machine: N cores; kernel X." for a report's header.
pub(crate) fn machine() -> String {
    format!(
        "Machine: {} cores; kernel {}.",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim()
    )
}

/// The "Targets" section of a report.
pub(crate) fn targets_markdown(targets: &[Target]) -> String {
    let mut md = String::from("## Targets\n\n| target | goal | measured | met |\n|---|---|---|---|\n");
    for t in targets {
        let met = match t.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "not measured",
        };
        let _ = writeln!(md, "| {} | {} | {} | {met} |", t.name, t.goal, t.measured);
    }
    md
}

/// The targets as report.json lists them.
pub(crate) fn targets_json(targets: &[Target]) -> Value {
    json!(targets.iter().map(|t| json!({"name": t.name, "goal": t.goal, "measured": t.measured, "met": t.met})).collect::<Vec<_>>())
}

/// The report of a `--only` run of one part: `markdown` under a header
/// naming the `part`, its targets; `doc` (a JSON object) with the targets
/// added; printed as well as written.
pub(crate) fn write_part(
    dir: &Path,
    part: &str,
    markdown: &str,
    mut doc: Value,
    targets: &[Target],
    svgs: &[(String, String)],
) -> std::io::Result<()> {
    let md = format!("# topoproxy benchmark: {part} only\n\n{}\n\n{markdown}{}", machine(), targets_markdown(targets));
    doc["targets"] = targets_json(targets);
    write_all(dir, &md, &doc, svgs)?;
    println!("{md}");
    println!("report written to {}", dir.join("report.md").display());
    Ok(())
}

pub(crate) fn write_all(dir: &Path, markdown: &str, json: &Value, svgs: &[(String, String)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("report.md"), markdown)?;
    std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(json).unwrap_or_default())?;
    for (name, svg) in svgs {
        std::fs::write(dir.join(name), svg)?;
    }
    Ok(())
}
