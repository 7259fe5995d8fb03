//! The HTML report of `warmpath simulate --report DIR` and `warmpath demo --report DIR`: one
//! self-contained page (`DIR/report.html`: inline SVG plots, no script, nothing fetched)
//! with the run's conditions, its table, and plots drawn with plotters: hit rate per
//! policy and tier, TTFT CDFs, and each instance's load over time.

use anyhow::{Context, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Plot size in pixels (the page scales them to its width).
const SIZE: (u32, u32) = (760, 380);
/// The tiers' colours: GPU, L1 (host memory), L2 (remote).
const TIER_COLOURS: [RGBColor; 3] = [
    RGBColor(46, 125, 50),
    RGBColor(21, 101, 192),
    RGBColor(239, 108, 0),
];

/// One plot of the report.
#[derive(Debug)]
pub struct Figure {
    pub title: String,
    /// An `<svg>` element.
    pub svg: String,
    /// What it shows and how to read it.
    pub caption: String,
}

/// An axis label: whole numbers from 10 up, one decimal below.
fn tick(v: &f64) -> String {
    if v.abs() >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The chart's legend, boxed, at `position`.
fn legend<'a, 'b: 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, CT>,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()?;
    Ok(())
}

fn draw(
    title: &str,
    caption: &str,
    paint: impl FnOnce(&DrawingArea<SVGBackend, plotters::coord::Shift>) -> Result<()>,
) -> Result<Figure> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        paint(&root)?;
        root.present()?;
    }
    Ok(Figure {
        title: title.to_string(),
        svg,
        caption: caption.to_string(),
    })
}

/// Stacked bars: for each policy, the share of prompt tokens found in GPU memory, L1 and
/// L2 (`rows`: name and the three shares, 0 to 1).
fn hit_rates(title: &str, caption: &str, rows: &[(String, [f64; 3])]) -> Result<Figure> {
    let top = rows
        .iter()
        .map(|(_, t)| t.iter().filter(|v| v.is_finite()).sum::<f64>())
        .fold(0.0, f64::max);
    let top = (top * 1.15).clamp(0.05, 1.0) * 100.0;
    let names: Vec<String> = rows.iter().map(|(n, _)| n.clone()).collect();
    draw(title, caption, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            // A segmented a..b has a slot for each of a..=b: one per row and a spare one
            // on the right, under the legend.
            .build_cartesian_2d((0..rows.len() as i32).into_segmented(), 0.0..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .max_light_lines(1)
            .y_desc("prompt tokens found cached (%)")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .draw()?;
        for (tier, name) in ["GPU", "L1 (host memory)", "L2 (remote)"]
            .iter()
            .enumerate()
        {
            let colour = TIER_COLOURS[tier];
            let bars = rows.iter().enumerate().map(|(i, (_, t))| {
                let shares = t.map(|v| if v.is_finite() { v * 100.0 } else { 0.0 });
                let below: f64 = shares[..tier].iter().sum();
                let x = i as i32;
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(x), below),
                        (SegmentValue::Exact(x + 1), below + shares[tier]),
                    ],
                    colour.filled(),
                );
                bar.set_margin(0, 0, 14, 14);
                bar
            });
            chart.draw_series(bars)?.label(*name).legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled())
            });
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    })
}

/// Cumulative distributions: each series is its values at the quantiles 0, 1/n, …, 1
/// (as `Curves::ttft_cdf_ms` holds them). The x axis is logarithmic when the values span
/// more than two decades.
fn cdfs(title: &str, caption: &str, x_desc: &str, series: &[(String, Vec<f64>)]) -> Result<Figure> {
    let values = || {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|v| v.is_finite())
    };
    let low = values().filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
    let high = values().fold(0.0, f64::max).max(1e-3);
    let low = if low.is_finite() {
        low.min(high)
    } else {
        high / 10.0
    };
    let points = |v: &[f64]| -> Vec<(f64, f64)> {
        let n = (v.len().max(2) - 1) as f64;
        v.iter()
            .enumerate()
            .map(|(i, x)| (x.max(low), i as f64 / n))
            .collect()
    };
    draw(title, caption, |root| {
        let mut builder = ChartBuilder::on(root);
        builder
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56);
        macro_rules! plot {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .max_light_lines(1)
                    .x_label_formatter(&tick)
                    .x_desc(x_desc)
                    .y_desc("fraction of requests")
                    .draw()?;
                for (i, (name, v)) in series.iter().enumerate() {
                    let colour = Palette99::pick(i).to_rgba();
                    chart
                        .draw_series(LineSeries::new(points(v), colour.stroke_width(2)))?
                        .label(name.as_str())
                        .legend(move |(x, y)| {
                            PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                        });
                }
                legend(&mut chart, SeriesLabelPosition::LowerRight)?;
            }};
        }
        if high / low > 100.0 {
            plot!(builder.build_cartesian_2d((low..high * 1.05).log_scale(), 0.0..1.0)?);
        } else {
            plot!(builder.build_cartesian_2d(0.0..high * 1.05, 0.0..1.0)?);
        }
        Ok(())
    })
}

/// Each instance's load over time: `samples` are (seconds, one value per instance).
fn load_over_time(
    title: &str,
    caption: &str,
    y_desc: &str,
    samples: &[(f64, Vec<f64>)],
) -> Result<Figure> {
    let instances = samples.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
    let end = samples.last().map_or(1.0, |(t, _)| t.max(1e-3));
    let top = samples
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.1;
    draw(title, caption, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..end, 0.0..top)?;
        chart
            .configure_mesh()
            .max_light_lines(1)
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .x_desc("seconds since the first request")
            .y_desc(y_desc)
            .draw()?;
        for i in 0..instances {
            let colour = Palette99::pick(i).to_rgba();
            let line = samples
                .iter()
                .map(|(t, v)| (*t, v.get(i).copied().unwrap_or(0.0)));
            chart
                .draw_series(LineSeries::new(line, colour.stroke_width(1)))?
                .label(format!("instance {i}"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour));
        }
        if instances <= 12 {
            legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        }
        Ok(())
    })
}

/// `a / b` as the tables print a ratio (`0.73x`), or `-` when `b` is not positive.
pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "-".to_string()
    }
}

/// Makes the report's directory before a run, so that one that cannot be written fails
/// at once, not after the run.
pub fn prepare(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--report {}: cannot make the directory", dir.display()))?;
    let probe = dir.join(".warmpath-report-probe");
    std::fs::write(&probe, b"")
        .with_context(|| format!("--report {}: cannot write there", dir.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// One policy's run, as the report plots it.
#[derive(Debug)]
pub struct Run {
    pub policy: String,
    /// Shares of prompt tokens found cached in GPU memory, L1 and L2 (0 to 1).
    pub tiers: [f64; 3],
    /// TTFT (ms) at the quantiles 0, 0.01, …, 1 (`warmpath_sim::stats::cdf`).
    pub ttft_cdf_ms: Vec<f64>,
    /// Each instance's requests waiting or running, at seconds since the first request.
    pub load: Vec<(f64, Vec<f64>)>,
}

/// Where a report's figures come from, for their captions.
#[derive(Debug)]
pub struct Provenance {
    /// Whose count the hit rates are ("token-weighted over the run").
    pub hit_rates: String,
    /// TTFT's unit and who measured it ("simulated ms").
    pub ttft: String,
    /// The TTFT axis ("TTFT (ms)").
    pub ttft_axis: String,
    /// How the load was taken, and the time it is plotted over ("over simulated time").
    pub load: String,
}

/// The figures of a comparison of policies: hit rate per policy and tier, TTFT CDFs, and
/// each policy's load per instance.
pub fn figures(runs: &[Run], from: &Provenance) -> Result<Vec<Figure>> {
    let tiers: Vec<(String, [f64; 3])> = runs.iter().map(|r| (r.policy.clone(), r.tiers)).collect();
    let cdfs_of: Vec<(String, Vec<f64>)> = runs
        .iter()
        .map(|r| (r.policy.clone(), r.ttft_cdf_ms.clone()))
        .collect();
    let mut figures = vec![
        hit_rates(
            "Hit rate per policy and tier",
            &format!(
                "Share of prompt tokens the engines found cached, by where they found them: \
                 their own GPU memory, their host's L1 (the cache-agent) or the shared L2; {}.",
                from.hit_rates
            ),
            &tiers,
        )?,
        cdfs(
            "Time to first token",
            &format!(
                "Cumulative distribution of TTFT per policy ({}): further left is faster; the \
                 top of each curve is the tail.",
                from.ttft
            ),
            &from.ttft_axis,
            &cdfs_of,
        )?,
    ];
    for r in runs {
        figures.push(load_over_time(
            &format!("Load per instance: {}", r.policy),
            &format!(
                "Requests waiting or running on each instance, {}: lines apart mean some \
                 instances queue while others idle.",
                from.load
            ),
            "requests waiting or running",
            &r.load,
        )?);
    }
    Ok(figures)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Writes `dir/report.html` (making `dir`): the title, the conditions (name, value), the
/// run's text table, and the figures. Returns the file's path.
pub fn write(
    dir: &Path,
    title: &str,
    conditions: &[(String, String)],
    table: &str,
    figures: &[Figure],
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{t}</title><style>\
         body{{font-family:system-ui,sans-serif;max-width:820px;margin:2em auto;padding:0 1em;color:#222}}\
         figure{{margin:2em 0}} figure svg{{width:100%;height:auto;border:1px solid #ddd}}\
         figcaption{{color:#555;font-size:.92em}} table{{border-collapse:collapse}}\
         td{{padding:.15em .8em .15em 0;vertical-align:top}} td:first-child{{color:#555}}\
         pre{{font-size:.78em;overflow-x:auto;background:#f6f6f6;padding:.8em}}\
         </style></head><body>\n<h1>{t}</h1>\n<table>\n",
        t = escape(title)
    );
    for (name, value) in conditions {
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td></tr>",
            escape(name),
            escape(value)
        );
    }
    html.push_str("</table>\n");
    for f in figures {
        let _ = write!(
            html,
            "<figure><h2>{}</h2>\n{}\n<figcaption>{}</figcaption></figure>\n",
            escape(&f.title),
            f.svg,
            escape(&f.caption)
        );
    }
    let _ = write!(
        html,
        "<h2>The run's table</h2>\n<pre>{}</pre>\n</body></html>\n",
        escape(table.trim_matches('\n'))
    );
    let path = dir.join("report.html");
    std::fs::write(&path, html).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_is_one_page_with_a_plot_per_figure_and_nothing_fetched() {
        let rows = vec![
            ("round-robin".to_string(), [0.2, 0.05, 0.0]),
            ("prefix-aware".to_string(), [0.7, 0.1, 0.02]),
        ];
        let cdf: Vec<f64> = (0..=100).map(|q| f64::from(q) * 3.0 + 1.0).collect();
        let load = vec![(0.0, vec![1.0, 2.0]), (1.0, vec![3.0, 0.0])];
        // One policy alone still gets its bar.
        let one = hit_rates("Hit rate", "one", &rows[..1]).unwrap();
        assert_eq!(one.svg.matches("round-robin").count(), 1, "{}", one.svg);
        let figures = vec![
            hit_rates("Hit rate", "per tier", &rows).unwrap(),
            cdfs("TTFT", "CDF", "ms", &[("a <b>".to_string(), cdf)]).unwrap(),
            load_over_time("Load", "in flight", "requests", &load).unwrap(),
        ];
        let dir = tempfile::tempdir().unwrap();
        let conditions = [("workload".to_string(), "bots & chat".to_string())];
        let path = write(
            dir.path(),
            "A <report>",
            &conditions,
            "policy hit%\n",
            &figures,
        )
        .unwrap();
        let html = std::fs::read_to_string(path).unwrap();
        assert_eq!(html.matches("<svg").count(), 3, "{html}");
        assert!(html.contains("<title>A &lt;report&gt;</title>"));
        assert!(html.contains("bots &amp; chat"));
        assert!(html.contains("prefix-aware") && html.contains("L2 (remote)"));
        // Self-contained: no scripts, no external references but the SVG namespace.
        assert!(!html.contains("<script"));
        let outside: Vec<&str> = html
            .match_indices("http")
            .map(|(i, _)| &html[i..(i + 40).min(html.len())])
            .filter(|s| !s.starts_with("http://www.w3.org/"))
            .collect();
        assert!(outside.is_empty(), "{outside:?}");
    }
}
