//! The training dashboard: header, charts on the left, GPUs, advice and events on the
//! right, footer.

use super::advisor::AdvisorView;
use super::charts::{LossChartView, OptimChartsView, ScuChartView};
use super::footer::FooterView;
use super::gpu::{GpuColumnView, PANEL_HEIGHT};
use super::header::HeaderView;
use super::log::LogView;
use super::throughput::{ThroughputView, THROUGHPUT_HEIGHT};
use crate::tui::app::App;
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::widgets::Widget;

/// The whole training screen.
pub struct TrainingView<'a> {
    app: &'a App,
}

impl<'a> TrainingView<'a> {
    /// The training screen for `app`.
    pub fn new(app: &'a App) -> TrainingView<'a> {
        TrainingView { app }
    }
}

impl Widget for TrainingView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let app = self.app;
        let theme = app.theme();
        let run = app.run();
        let ui = app.ui();
        let header = HeaderView {
            run,
            commands: app.commands(),
            status: app.status(),
            paused_for: app.paused_for(),
            viewer: app.viewer(),
            source: app.source(),
            theme,
        };
        let [header_area, body, footer_area] = Layout::vertical([
            Constraint::Length(header.height(area.width)),
            Constraint::Fill(1),
            Constraint::Length(1),
        ])
        .areas(area);
        header.render(header_area, buf);

        let [charts, side] =
            Layout::horizontal([Constraint::Percentage(58), Constraint::Percentage(42)])
                .areas(body);

        // charts: loss gets the most room; the SCU row only when SCU is on
        let scu_on = run.info.as_ref().is_some_and(|i| i.scu_enabled);
        let (loss, scu, optim) = if scu_on {
            let [loss, scu, optim] = Layout::vertical([
                Constraint::Fill(3),
                Constraint::Fill(2),
                Constraint::Fill(2),
            ])
            .areas(charts);
            (loss, Some(scu), optim)
        } else {
            let [loss, optim] =
                Layout::vertical([Constraint::Fill(3), Constraint::Fill(2)]).areas(charts);
            (loss, None, optim)
        };
        if let Some(scu) = scu {
            ScuChartView {
                run,
                recent: ui.recent,
                theme,
            }
            .render(scu, buf);
        }
        LossChartView {
            run,
            smoothing: ui.smoothing,
            recent: ui.recent,
            theme,
        }
        .render(loss, buf);
        OptimChartsView {
            run,
            recent: ui.recent,
            theme,
        }
        .render(optim, buf);

        // side: as many GPU panels as fit in ~40% of the height, throughput when there is
        // room, then advice and events
        let telemetry = app.telemetry();
        let whole_panels = (side.height * 2 / 5 / PANEL_HEIGHT).max(1);
        let gpu_height = GpuColumnView::wanted_height(telemetry).min(whole_panels * PANEL_HEIGHT);
        let throughput_height = match side.height.saturating_sub(gpu_height) {
            h if h >= 26 => THROUGHPUT_HEIGHT,
            h if h >= 15 => THROUGHPUT_HEIGHT - 1,
            _ => 0,
        };
        let [gpus, throughput, advice, events] = Layout::vertical([
            Constraint::Length(gpu_height),
            Constraint::Length(throughput_height),
            Constraint::Fill(1),
            Constraint::Fill(1),
        ])
        .areas(side);
        GpuColumnView {
            telemetry,
            focus: ui.focus_gpu,
            stretch: false,
            theme,
        }
        .render(gpus, buf);
        if throughput_height > 0 {
            ThroughputView {
                run,
                paused: app.paused_for().is_some(),
                theme,
            }
            .render(throughput, buf);
        }
        AdvisorView {
            advice: &telemetry.advice,
            has_telemetry: telemetry.updates > 0,
            theme,
        }
        .render(advice, buf);
        LogView {
            log: app.log(),
            theme,
        }
        .render(events, buf);

        FooterView {
            mode: app.mode(),
            status: app.status(),
            notice: ui.notice.as_ref(),
            commands: app.commands(),
            keymap: app.keymap(),
            paused: run.paused,
            viewer: app.viewer(),
            gpu_panels: telemetry.gpus.len(),
            scu: scu_on,
            theme,
        }
        .render(footer_area, buf);
    }
}
