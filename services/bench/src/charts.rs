//! SVG charts of a report (plotters, SVG backend): latency CDFs per mode, TTFT by turn number
//! per mode, and throughput against concurrency (with the latency–throughput curve).

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

use crate::{
    report::{ModeReport, Report, fmt_ms},
    workload::Level,
};

/// Most points drawn per CDF line: enough for a smooth curve, small enough to keep the SVG
/// files reviewable in the repository (tens of KiB).
pub const MAX_CDF_POINTS: usize = 400;

/// File names and titles of the charts [`write_all`] makes.
pub const CHARTS: [(&str, &str); 3] = [
    (
        "latency_cdf.svg",
        "Latency CDF per mode (TTFT and end-to-end)",
    ),
    ("ttft_by_turn.svg", "TTFT by turn number per mode"),
    (
        "throughput_vs_concurrency.svg",
        "Throughput against concurrency, and p99 against throughput",
    ),
];

/// The colour of a mode (stable across charts).
fn colour(label: &str, index: usize) -> RGBColor {
    match label {
        "collapsed" => RGBColor(31, 119, 180),
        "split" => RGBColor(44, 160, 44),
        "layered" => RGBColor(214, 39, 40),
        _ => [
            RGBColor(148, 103, 189),
            RGBColor(255, 127, 14),
            RGBColor(140, 86, 75),
        ][index % 3],
    }
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e}")
}

/// Writes every chart of `report` into `dir`.
pub fn write_all(report: &Report, dir: &Path) -> anyhow::Result<()> {
    let modes = report.ordered_modes();
    latency_cdf(report, &modes, &dir.join(CHARTS[0].0))?;
    ttft_by_turn(&modes, &dir.join(CHARTS[1].0))?;
    throughput(&modes, &dir.join(CHARTS[2].0))?;
    Ok(())
}

/// `(value, cumulative fraction)` points of the empirical CDF, thinned to at most
/// [`MAX_CDF_POINTS`] (the last point is always kept).
pub fn cdf_points(mut v: Vec<f64>) -> Vec<(f64, f64)> {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(MAX_CDF_POINTS).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect();
    if pts.last().is_some_and(|p| p.1 < 1.0) {
        pts.push((v[n - 1], 1.0));
    }
    pts
}

/// An axis over positive values: logarithmic when they span more than [`LOG_AXIS_SPAN`]×,
/// else linear. A logarithmic axis is drawn as a linear axis over log10 values whose labels
/// show the real values (plotters' own log axes label narrow ranges with one or two ticks).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Axis {
    /// Logarithmic.
    log: bool,
    /// Smallest value shown (real units).
    lo: f64,
    /// Largest value shown (real units).
    hi: f64,
}

/// Value spans above which an axis becomes logarithmic: below it a linear axis reads better.
const LOG_AXIS_SPAN: f64 = 8.0;

impl Axis {
    /// An axis covering `values` (non-positive and non-finite values ignored) with a margin.
    fn covering(values: impl Iterator<Item = f64>) -> Self {
        let (lo, hi) = values
            .filter(|v| v.is_finite() && *v > 0.0)
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        if !lo.is_finite() {
            return Self {
                log: false,
                lo: 0.0,
                hi: 1.0,
            };
        }
        if hi / lo > LOG_AXIS_SPAN {
            Self {
                log: true,
                lo: lo / 1.25,
                hi: hi * 1.25,
            }
        } else {
            Self {
                log: false,
                lo: 0.0,
                hi: (hi * 1.15).max(lo * 1.5),
            }
        }
    }

    /// Where `v` is drawn.
    fn map(&self, v: f64) -> f64 {
        if self.log { v.max(self.lo).log10() } else { v }
    }

    /// The drawing range.
    fn range(&self) -> std::ops::Range<f64> {
        self.map(self.lo)..self.map(self.hi)
    }

    /// The label of drawn position `x`.
    fn label(&self, x: f64) -> String {
        fmt_ms(if self.log { 10f64.powf(x) } else { x })
    }

    /// "`desc` (log scale)" when logarithmic.
    fn desc(&self, desc: &str) -> String {
        if self.log {
            format!("{desc} (log scale)")
        } else {
            desc.to_owned()
        }
    }
}

/// A chart with plain `f64` axes on an SVG drawing area (every chart here).
type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// One mode's line with its legend entry, plus a dot at every point when `dots`.
fn draw_mode_line(
    chart: &mut Chart<'_, '_>,
    pts: Vec<(f64, f64)>,
    c: RGBColor,
    label: &str,
    dots: bool,
) -> anyhow::Result<()> {
    let dot_pts = if dots { pts.clone() } else { Vec::new() };
    chart
        .draw_series(LineSeries::new(pts, c.stroke_width(2)))
        .map_err(err)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    chart
        .draw_series(dot_pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))
        .map_err(err)?;
    Ok(())
}

/// The legend of the modes' lines at `position`.
fn draw_legend<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn latency_cdf(report: &Report, modes: &[&ModeReport], path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(500);
    let values = |m: &ModeReport, ttft: bool| -> Vec<f64> {
        report
            .samples
            .iter()
            .filter(|s| s.mode == m.label && s.is_ok())
            .filter_map(|s| if ttft { s.ttft_ms } else { Some(s.e2e_ms) })
            .collect()
    };
    let panels = [
        (&left, "time to first token", true),
        (&right, "end-to-end latency", false),
    ];
    for (area, title, ttft) in panels {
        let series: Vec<(String, Vec<(f64, f64)>)> = modes
            .iter()
            .map(|m| (m.label.clone(), cdf_points(values(m, ttft))))
            .collect();
        let x = Axis::covering(series.iter().flat_map(|(_, p)| p.iter().map(|v| v.0)));
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(x.range(), 0f64..1.0f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(x.desc("ms"))
            .y_desc("fraction of requests")
            .x_labels(8)
            .x_label_formatter(&|v| x.label(*v))
            .draw()
            .map_err(err)?;
        for (i, (label, pts)) in series.into_iter().enumerate() {
            let c = colour(&label, i);
            let pts: Vec<(f64, f64)> = pts.into_iter().map(|(v, f)| (x.map(v), f)).collect();
            draw_mode_line(&mut chart, pts, c, &label, false)?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

fn ttft_by_turn(modes: &[&ModeReport], path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (700, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let turns = modes
        .iter()
        .map(|m| m.by_turn.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let top = modes
        .iter()
        .flat_map(|m| m.by_turn.iter().filter_map(|t| t.ttft_ms.map(|p| p.p95)))
        .fold(0.0f64, f64::max)
        .max(0.001)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT by turn (p50 solid, p95 dashed)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5f64..turns as f64 + 0.5, 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("turn")
        .y_desc("TTFT ms")
        .x_labels(turns.min(20))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    for (i, m) in modes.iter().enumerate() {
        let c = colour(&m.label, i);
        let p50: Vec<(f64, f64)> = m
            .by_turn
            .iter()
            .filter_map(|t| t.ttft_ms.map(|p| (t.turn as f64, p.p50)))
            .collect();
        let p95: Vec<(f64, f64)> = m
            .by_turn
            .iter()
            .filter_map(|t| t.ttft_ms.map(|p| (t.turn as f64, p.p95)))
            .collect();
        draw_mode_line(&mut chart, p50, c, &m.label, true)?;
        chart
            .draw_series(DashedLineSeries::new(p95, 6, 4, c.stroke_width(1)))
            .map_err(err)?;
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(err)?;
    Ok(())
}

/// The x of a level on the throughput chart: its concurrency or offered rate; staged load
/// uses the mean requests in flight it produced.
fn level_x(level: &Level, mean_in_flight: f64) -> f64 {
    match level {
        Level::Staged => mean_in_flight.max(1.0),
        l => l.x(),
    }
}

fn throughput(modes: &[&ModeReport], path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(500);
    let open = modes
        .iter()
        .any(|m| m.by_level.iter().any(|l| matches!(l.level, Level::Rate(_))));
    let x = Axis::covering(modes.iter().flat_map(|m| {
        m.by_level
            .iter()
            .map(|l| level_x(&l.level, l.mean_in_flight))
    }));
    let ymax = modes
        .iter()
        .flat_map(|m| m.by_level.iter().map(|l| l.requests_per_s))
        .fold(0.0f64, f64::max)
        .max(0.001)
        * 1.15;
    let mut chart = ChartBuilder::on(&left)
        .caption("requests/s against load", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x.range(), 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x.desc(if open {
            "offered rate (arrivals/s)"
        } else {
            "concurrency"
        }))
        .y_desc("requests/s")
        .x_labels(8)
        .x_label_formatter(&|v| x.label(*v))
        .draw()
        .map_err(err)?;
    for (i, m) in modes.iter().enumerate() {
        let c = colour(&m.label, i);
        let pts: Vec<(f64, f64)> = m
            .by_level
            .iter()
            .map(|l| (x.map(level_x(&l.level, l.mean_in_flight)), l.requests_per_s))
            .collect();
        draw_mode_line(&mut chart, pts, c, &m.label, true)?;
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;

    let pts_of = |m: &ModeReport| -> Vec<(f64, f64)> {
        m.by_level
            .iter()
            .filter_map(|l| l.e2e_ms.map(|p| (l.requests_per_s, p.p99)))
            .filter(|p| p.0 > 0.0)
            .collect()
    };
    let y = Axis::covering(
        modes
            .iter()
            .flat_map(|m| pts_of(m).into_iter().map(|p| p.1)),
    );
    let x = Axis::covering(
        modes
            .iter()
            .flat_map(|m| pts_of(m).into_iter().map(|p| p.0)),
    );
    let mut chart = ChartBuilder::on(&right)
        .caption("e2e p99 against requests/s", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x.range(), y.range())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x.desc("requests/s"))
        .y_desc(y.desc("e2e p99 ms"))
        .x_labels(8)
        .y_labels(8)
        .x_label_formatter(&|v| x.label(*v))
        .y_label_formatter(&|v| y.label(*v))
        .draw()
        .map_err(err)?;
    for (i, m) in modes.iter().enumerate() {
        let c = colour(&m.label, i);
        let pts: Vec<(f64, f64)> = pts_of(m)
            .into_iter()
            .map(|(a, b)| (x.map(a), y.map(b)))
            .collect();
        draw_mode_line(&mut chart, pts, c, &m.label, true)?;
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_points_end_at_one_and_are_thinned() {
        let pts = cdf_points((1..=10_000).map(f64::from).collect());
        assert!(pts.len() <= MAX_CDF_POINTS + 1);
        assert_eq!(pts.last(), Some(&(10_000.0, 1.0)));
        assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert_eq!(cdf_points(vec![2.0, 1.0]), vec![(1.0, 0.5), (2.0, 1.0)]);
        assert!(cdf_points(Vec::new()).is_empty());
    }

    #[test]
    fn axes_turn_logarithmic_only_for_wide_spans() {
        assert_eq!(
            Axis::covering(std::iter::empty()),
            Axis {
                log: false,
                lo: 0.0,
                hi: 1.0
            }
        );
        let narrow = Axis::covering([0.0, 5.0, 10.0].into_iter());
        assert!(!narrow.log && narrow.lo == 0.0 && narrow.hi > 10.0);
        let wide = Axis::covering([1.0, 1000.0].into_iter());
        assert!(wide.log && wide.lo < 1.0 && wide.hi > 1000.0);
        assert_eq!(wide.map(100.0), 2.0);
        assert_eq!(wide.label(2.0), "100");
    }
}
