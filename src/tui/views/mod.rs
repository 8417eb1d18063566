//! Widgets that draw the dashboard from state. Each `XxxView` borrows what it shows and
//! renders into a rectangle; [`render`] lays the whole screen out.

pub mod advisor;
pub mod charts;
pub mod compare;
pub mod footer;
pub mod gpu;
pub mod header;
pub mod log;
pub mod monitor;
pub mod plot;
pub mod popup;
pub mod processes;
pub mod throughput;
pub mod training;

use super::app::{App, Mode, Overlay};
use super::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, BorderType, Paragraph, Widget, Wrap};
use ratatui::Frame;

/// Smallest terminal the training dashboard draws in (columns, rows).
pub const TRAINING_MIN_SIZE: (u16, u16) = (72, 22);
/// Smallest terminal the monitor dashboard draws in (columns, rows).
pub const MONITOR_MIN_SIZE: (u16, u16) = (56, 14);

impl App {
    /// Draws the whole dashboard.
    pub fn render(&self, frame: &mut Frame) {
        render(self, frame);
    }
}

/// Draws the dashboard for `app` over the whole frame.
pub fn render(app: &App, frame: &mut Frame) {
    let area = frame.area();
    let buf = frame.buffer_mut();
    Block::new().style(app.theme().base()).render(area, buf);
    let (min_w, min_h) = match app.mode() {
        Mode::Training => TRAINING_MIN_SIZE,
        Mode::Monitor => MONITOR_MIN_SIZE,
    };
    if area.width < min_w || area.height < min_h {
        TooSmallView {
            need: (min_w, min_h),
            have: (area.width, area.height),
            theme: app.theme(),
        }
        .render(area, buf);
        return;
    }
    match app.mode() {
        Mode::Training => training::TrainingView::new(app).render(area, buf),
        Mode::Monitor => monitor::MonitorView::new(app).render(area, buf),
    }
    match app.ui().overlay {
        Overlay::None => {}
        Overlay::Help => popup::HelpView::new(app).render(area, buf),
        Overlay::QuitConfirm { selected } => popup::QuitView {
            selected,
            theme: app.theme(),
            discard: app.keymap().discard_key(),
        }
        .render(area, buf),
    }
}

/// Shown instead of the dashboard when the terminal is too small.
pub struct TooSmallView<'a> {
    /// Columns and rows needed.
    pub need: (u16, u16),
    /// Columns and rows available.
    pub have: (u16, u16),
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for TooSmallView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let text = vec![
            Line::from(Span::styled("enlarge the terminal", self.theme.title())),
            Line::from(format!(
                "(need ≥ {}x{}, have {}x{})",
                self.need.0, self.need.1, self.have.0, self.have.1
            )),
        ];
        let height = 2.min(area.height);
        let [_, middle, _] = Layout::vertical([
            Constraint::Fill(1),
            Constraint::Length(height),
            Constraint::Fill(1),
        ])
        .areas(area);
        Paragraph::new(text)
            .alignment(Alignment::Center)
            .wrap(Wrap { trim: true })
            .style(self.theme.base())
            .render(middle, buf);
    }
}

/// A bordered panel with a title in the theme's colours.
pub fn panel<'a>(title: impl Into<Line<'a>>, theme: &Theme, focused: bool) -> Block<'a> {
    Block::bordered()
        .border_type(if focused {
            BorderType::Thick
        } else {
            BorderType::Rounded
        })
        .border_style(theme.border(focused))
        .title(title.into().style(theme.title()))
        .style(theme.base())
}

/// A rectangle of at most `width`×`height` centred in `area`.
pub fn centered(area: Rect, width: u16, height: u16) -> Rect {
    let w = width.min(area.width);
    let h = height.min(area.height);
    Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    }
}

/// Packs segments into lines of at most `width` columns, joined by `sep`; at most
/// `max_lines` lines (segments that do not fit are dropped, so put the important first).
pub fn flow<'a>(
    segments: Vec<Vec<Span<'a>>>,
    sep: Span<'a>,
    width: u16,
    max_lines: usize,
) -> Vec<Line<'a>> {
    let width = usize::from(width);
    let sep_width = sep.width();
    let mut lines: Vec<Line<'a>> = Vec::new();
    let mut current: Vec<Span<'a>> = Vec::new();
    let mut used = 0usize;
    for segment in segments {
        let mut segment = segment;
        let mut w: usize = segment.iter().map(Span::width).sum();
        if w == 0 {
            continue;
        }
        if w > width {
            // wider than a whole line: elided, never cut mid-way without a mark
            segment = elide_spans(segment, width);
            w = width;
        }
        let needed = if current.is_empty() { w } else { w + sep_width };
        if used + needed > width && !current.is_empty() {
            lines.push(Line::from(std::mem::take(&mut current)));
            used = 0;
            if lines.len() == max_lines {
                return lines;
            }
        }
        if !current.is_empty() {
            current.push(sep.clone());
            used += sep_width;
        }
        used += w;
        current.extend(segment);
    }
    if !current.is_empty() && lines.len() < max_lines {
        lines.push(Line::from(current));
    }
    lines
}

/// Columns `s` takes on a terminal.
pub fn text_width(s: &str) -> usize {
    Span::raw(s).width()
}

/// `s` in at most `width` columns: whole, or cut with "…" at the end.
pub fn elide(s: &str, width: usize) -> String {
    if text_width(s) <= width {
        return s.to_string();
    }
    cut(s, width)
}

/// The start of `s` that fits `width` columns with a "…" after it.
fn cut(s: &str, width: usize) -> String {
    if width == 0 {
        return String::new();
    }
    let mut out = String::new();
    let mut used = 0;
    for c in s.chars() {
        let w = text_width(c.encode_utf8(&mut [0; 4]));
        if used + w + 1 > width {
            break;
        }
        out.push(c);
        used += w;
    }
    out.push('…');
    out
}

/// Spans cut to at most `width` columns, ending in "…" when anything was cut.
pub fn elide_spans<'a>(spans: Vec<Span<'a>>, width: usize) -> Vec<Span<'a>> {
    let total: usize = spans.iter().map(Span::width).sum();
    if total <= width {
        return spans;
    }
    let mut out = Vec::new();
    let mut left = width;
    for span in spans {
        let w = span.width();
        if w < left {
            left -= w;
            out.push(span);
            continue;
        }
        // this span holds the cut: it ends in "…"
        if left > 0 {
            out.push(Span::styled(cut(&span.content, left), span.style));
        }
        break;
    }
    if out.is_empty() && width > 0 {
        out.push(Span::raw("…"));
    }
    out
}

/// One line of at most `width` columns from segments in order of importance: whole segments
/// while they fit; the first that does not is elided with "…" when at least `min_part`
/// columns are left for it, else stands as a lone "…" (a value is never shown cut), and
/// nothing after it is shown.
pub fn fit<'a>(segments: Vec<Vec<Span<'a>>>, width: usize, min_part: usize) -> Line<'a> {
    let mut spans: Vec<Span<'a>> = Vec::new();
    let mut used = 0usize;
    for segment in segments {
        let w: usize = segment.iter().map(Span::width).sum();
        if used + w <= width {
            used += w;
            spans.extend(segment);
            continue;
        }
        let left = width - used;
        if left >= min_part.max(2) {
            spans.extend(elide_spans(segment, left));
        } else if left >= 1 {
            let style = segment.first().map(|s| s.style).unwrap_or_default();
            spans.push(Span::styled("…", style));
        }
        break;
    }
    Line::from(spans)
}
