//! Text and JSON renderings of a [`MonitorUpdate`] for the headless monitor.

use serde::Serialize;

use crate::advisor::{MonitorUpdate, Recommendation, Severity};
use crate::telemetry::{GpuSample, HostSample};

/// The JSON object printed by `--once --json` (and, one per line, by `--json`).
#[derive(Serialize)]
struct UpdateJson<'a> {
    timestamp_ms: u64,
    gpus: &'a [GpuSample],
    host: &'a HostSample,
    gpu_notice: Option<&'a str>,
    advice: &'a [Recommendation],
}

/// One update as a single-line JSON object: `timestamp_ms`, `gpus`, `host`, `gpu_notice`
/// (null when GPU metrics are there) and `advice`. See the [module docs](crate::monitor).
pub fn update_json(update: &MonitorUpdate) -> serde_json::Result<String> {
    serde_json::to_string(&UpdateJson {
        timestamp_ms: update.snapshot.timestamp_ms,
        gpus: &update.snapshot.gpus,
        host: &update.snapshot.host,
        gpu_notice: update.snapshot.gpu_notice.as_deref(),
        advice: &update.advice,
    })
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / GIB)
}

fn opt<T: std::fmt::Display>(value: Option<T>, unit: &str) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v}{unit}"))
}

fn clock(timestamp_ms: u64, format: &str) -> String {
    i64::try_from(timestamp_ms)
        .ok()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map(|t| t.with_timezone(&chrono::Local).format(format).to_string())
        .unwrap_or_else(|| "--:--:--".to_string())
}

fn severity_label(severity: Severity) -> &'static str {
    match severity {
        Severity::Info => "info",
        Severity::Warn => "warn",
        Severity::Critical => "CRIT",
    }
}

fn advice_tag(rec: &Recommendation) -> String {
    match rec.gpu {
        Some(gpu) => format!("{}(gpu{gpu})", rec.id),
        None => rec.id.clone(),
    }
}

/// One status line: per GPU utilization, memory, temperature and power; host CPU and RAM;
/// the top advice.
///
/// `12:00:01  gpu0 87% 41.2/80.0G 64°C 310W | cpu 23% ram 12.1/24.0G | advice: data_bound(gpu0) +1`
pub fn status_line(update: &MonitorUpdate) -> String {
    let snapshot = &update.snapshot;
    let mut parts: Vec<String> = snapshot
        .gpus
        .iter()
        .map(|g| {
            format!(
                "gpu{} {} {}/{}G {} {}",
                g.index,
                opt(g.util_gpu, "%"),
                gib(g.mem_used_bytes),
                gib(g.mem_total_bytes),
                opt(g.temperature_c, "°C"),
                opt(g.power_w.map(|w| format!("{w:.0}")), "W"),
            )
        })
        .collect();
    if parts.is_empty() {
        parts.push("no gpu".to_string());
    }
    let host = &snapshot.host;
    parts.push(format!(
        "cpu {:.0}% ram {}/{}G",
        host.cpu_pct,
        gib(host.ram_used_bytes),
        gib(host.ram_total_bytes)
    ));
    let advice = match update.advice.split_first() {
        None => "advice: -".to_string(),
        Some((top, [])) => format!("advice: {}", advice_tag(top)),
        Some((top, rest)) => format!("advice: {} +{}", advice_tag(top), rest.len()),
    };
    parts.push(advice);
    format!(
        "{}  {}",
        clock(snapshot.timestamp_ms, "%H:%M:%S"),
        parts.join(" | ")
    )
}

/// A multi-line, human-readable status block (`cockpit monitor --once`).
pub fn status_block(update: &MonitorUpdate) -> String {
    let snapshot = &update.snapshot;
    let mut out = vec![format!(
        "cockpit monitor  {}",
        clock(snapshot.timestamp_ms, "%Y-%m-%d %H:%M:%S")
    )];
    if let Some(notice) = &snapshot.gpu_notice {
        out.push(format!("note: {notice}"));
    }
    for g in &snapshot.gpus {
        out.extend(gpu_block(g));
    }
    let host = &snapshot.host;
    out.push(format!(
        "Host    cpu {:.0}% of {} cores   ram {} / {} GiB   cockpit rss {:.0} MiB",
        host.cpu_pct,
        host.cpu_cores,
        gib(host.ram_used_bytes),
        gib(host.ram_total_bytes),
        host.self_rss_bytes as f64 / f64::from(1u32 << 20),
    ));
    if update.advice.is_empty() {
        out.push("Advice  none".to_string());
    } else {
        out.push("Advice".to_string());
        for rec in &update.advice {
            out.push(format!(
                "  [{}] {}: {}",
                severity_label(rec.severity),
                rec.id,
                rec.message
            ));
            if !rec.evidence.is_empty() {
                let evidence: Vec<String> = rec
                    .evidence
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                out.push(format!("         evidence: {}", evidence.join(", ")));
            }
            let key = rec
                .key
                .as_deref()
                .map(|k| format!(" [key {k}]"))
                .unwrap_or_default();
            out.push(format!("         action: {}{key}", rec.action));
        }
    }
    out.join("\n") + "\n"
}

fn gpu_block(g: &GpuSample) -> Vec<String> {
    let cc = g
        .compute_capability
        .map(|(major, minor)| format!("  (compute capability {major}.{minor})"))
        .unwrap_or_default();
    let mut lines = vec![format!("GPU {}   {}{cc}", g.index, g.name)];
    lines.push(format!(
        "  util {}  mem-util {}  memory {} / {} GiB ({:.0}%)",
        opt(g.util_gpu, "%"),
        opt(g.util_mem, "%"),
        gib(g.mem_used_bytes),
        gib(g.mem_total_bytes),
        g.mem_used_frac() * 100.0,
    ));
    let power = match (g.power_w, g.power_limit_w) {
        (Some(w), Some(limit)) => format!("{w:.0} / {limit:.0} W"),
        (Some(w), None) => format!("{w:.0} W"),
        _ => "-".to_string(),
    };
    lines.push(format!(
        "  temp {}  power {power}  fan {}  sm clock {} / {} MHz  mem clock {} / {} MHz",
        opt(g.temperature_c, "°C"),
        opt(g.fan_pct, "%"),
        opt(g.sm_clock_mhz, ""),
        opt(g.sm_clock_max_mhz, ""),
        opt(g.mem_clock_mhz, ""),
        opt(g.mem_clock_max_mhz, ""),
    ));
    let mb = |kbps: Option<u32>| {
        opt(
            kbps.map(|k| format!("{:.1}", f64::from(k) / 1000.0)),
            " MB/s",
        )
    };
    let mut pcie = format!(
        "  pcie rx {}  tx {}",
        mb(g.pcie_rx_kbps),
        mb(g.pcie_tx_kbps)
    );
    if g.sm_activity_pct.is_some() || g.sm_occupancy_pct.is_some() {
        pcie.push_str(&format!(
            "  sm activity {}  sm occupancy {}",
            opt(g.sm_activity_pct.map(|v| format!("{v:.0}")), "%"),
            opt(g.sm_occupancy_pct.map(|v| format!("{v:.0}")), "%"),
        ));
    }
    lines.push(pcie);
    if !g.throttle_reasons.is_empty() {
        lines.push(format!("  throttle: {}", g.throttle_reasons.join(", ")));
    }
    if g.processes.is_empty() {
        lines.push("  processes: none".to_string());
    } else {
        for p in &g.processes {
            let mem = p
                .gpu_memory_bytes
                .map(|b| format!("  {} GiB", gib(b)))
                .unwrap_or_default();
            lines.push(format!("  process {}{mem} [{}]", p.label(), p.kind));
        }
    }
    lines
}
