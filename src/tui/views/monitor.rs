//! The monitor dashboard: GPU panels and advice on top, the GPU process table below.

use super::advisor::AdvisorView;
use super::flow;
use super::footer::FooterView;
use super::gpu::GpuColumnView;
use super::processes::ProcessTableView;
use crate::tui::app::App;
use crate::tui::fmt;
use crate::tui::theme::Level;
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::Span;
use ratatui::widgets::{Paragraph, Widget};

/// The whole monitor screen.
pub struct MonitorView<'a> {
    app: &'a App,
}

impl<'a> MonitorView<'a> {
    /// The monitor screen for `app`.
    pub fn new(app: &'a App) -> MonitorView<'a> {
        MonitorView { app }
    }
}

impl Widget for MonitorView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let app = self.app;
        let t = app.theme();
        let tel = app.telemetry();
        let host = &tel.host;

        let label = |s: &str| Span::styled(format!("{s} "), t.muted());
        let mut segments = vec![vec![Span::styled("cockpit monitor", t.title())]];
        if let Some(source) = app.source() {
            segments.push(vec![Span::styled(source.to_string(), t.level(Level::Warn))]);
        }
        if tel.updates == 0 {
            segments.push(vec![Span::styled("waiting for telemetry…", t.muted())]);
        } else {
            let gpus = match tel.gpus.len() {
                0 => Span::styled("no GPUs", t.level(Level::Warn)),
                1 => Span::raw("1 GPU"),
                n => Span::raw(format!("{n} GPUs")),
            };
            segments.push(vec![gpus]);
            segments.push(vec![
                label("CPU"),
                Span::raw(format!("{:.0}% of {} cores", host.cpu_pct, host.cpu_cores)),
            ]);
            segments.push(vec![
                label("RAM"),
                Span::raw(format!(
                    "{} / {}",
                    fmt::bytes(host.ram_used_bytes),
                    fmt::bytes(host.ram_total_bytes)
                )),
            ]);
            segments.push(vec![label("samples"), Span::raw(fmt::count(tel.updates))]);
        }
        let header_lines = flow(segments, Span::styled(" · ", t.muted()), area.width, 2);

        let [header, body, footer] = Layout::vertical([
            Constraint::Length(header_lines.len() as u16),
            Constraint::Fill(1),
            Constraint::Length(1),
        ])
        .areas(area);
        Paragraph::new(header_lines).render(header, buf);

        // GPUs and advice on top, sharing the spare rows; processes below
        let processes = tel.processes();
        // no process table on a machine without GPUs: there is nothing it could list
        let table_height = if tel.gpus.is_empty() {
            0
        } else {
            (processes.len() as u16 + 3).min((body.height / 3).max(4))
        };
        let [top, table] =
            Layout::vertical([Constraint::Fill(1), Constraint::Length(table_height)]).areas(body);
        let [gpus, advice] =
            Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(top);
        GpuColumnView {
            telemetry: tel,
            focus: app.ui().focus_gpu,
            stretch: true,
            theme: t,
        }
        .render(gpus, buf);
        AdvisorView {
            advice: &tel.advice,
            has_telemetry: tel.updates > 0,
            theme: t,
        }
        .render(advice, buf);
        if table_height > 0 {
            ProcessTableView {
                rows: &processes,
                theme: t,
            }
            .render(table, buf);
        }

        FooterView {
            mode: app.mode(),
            status: app.status(),
            notice: app.ui().notice.as_ref(),
            commands: app.commands(),
            keymap: app.keymap(),
            paused: false,
            viewer: app.viewer(),
            gpu_panels: tel.gpus.len(),
            scu: false,
            theme: t,
        }
        .render(footer, buf);
    }
}
