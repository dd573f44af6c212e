//! What the desktop tray shows (G4): the gateway's state in one colour and one line, and
//! the tray icon with a badge of that colour. Pure, so it is tested here; the desktop
//! shell only puts the result on screen.

use spillway_engine::AppState;
use spillway_engine::health::RotationState;

/// How the gateway is doing, worst first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// A breaker is open, or the ledger refuses writes: someone should look now.
    Critical,
    /// A breaker is on probation, or a channel is out of rotation.
    Degraded,
    Ok,
}

impl Level {
    /// The badge colour (RGBA).
    pub fn color(self) -> [u8; 4] {
        match self {
            Level::Critical => [0xef, 0x44, 0x44, 0xff],
            Level::Degraded => [0xf5, 0x9e, 0x0b, 0xff],
            Level::Ok => [0x10, 0xb9, 0x81, 0xff],
        }
    }
}

/// The level and the tray's tooltip.
pub fn status(st: &AppState) -> (Level, String) {
    use spillway_control::BreakerState;
    let h = st.metrics.headline(spillway_engine::clock::now().0.div_euclid(1000));
    let control = st.control.views(st);
    let open: Vec<&str> = control
        .iter()
        .filter(|v| v.breaker.state == BreakerState::Open)
        .map(|v| v.route.as_str())
        .collect();
    let probation = control.iter().any(|v| v.breaker.state == BreakerState::Probation);
    let now = tokio::time::Instant::now();
    let out: Vec<String> = st
        .channels
        .iter()
        .filter(|c| {
            !matches!(
                c.health.view(now).state,
                RotationState::Ready | RotationState::Recovering
            )
        })
        .map(|c| c.cfg.name.clone())
        .collect();
    let ledger_ok = st.ledger.is_healthy();
    let errors = h
        .error_rate
        .map(|r| format!("{:.1} % errors", r * 100.0))
        .unwrap_or_else(|| "no traffic yet".into());
    let mut text = format!(
        "Spillway — {:.1} req/s, {errors}, {} in flight",
        h.requests_per_s, h.in_flight
    );
    if !open.is_empty() {
        text += &format!("\nBreaker open: {}", open.join(", "));
    }
    if !out.is_empty() {
        text += &format!("\nOut of rotation: {}", out.join(", "));
    }
    if !ledger_ok {
        text += "\nThe ledger is refusing writes";
    }
    let level = if !open.is_empty() || !ledger_ok {
        Level::Critical
    } else if probation || !out.is_empty() {
        Level::Degraded
    } else {
        Level::Ok
    };
    (level, text)
}

/// `icon` (RGBA, `width` × `height`) with a filled dot of `level`'s colour in its
/// bottom-right corner, ringed in white so it reads on dark and light panels.
pub fn badge(icon: &[u8], width: u32, height: u32, level: Level) -> Vec<u8> {
    let mut out = icon.to_vec();
    let (w, h) = (width as i64, height as i64);
    let r = (w.min(h) as f64 * 0.22).max(2.0);
    let (cx, cy) = (w as f64 - r - 1.0, h as f64 - r - 1.0);
    for y in 0..h {
        for x in 0..w {
            let d = ((x as f64 + 0.5 - cx).powi(2) + (y as f64 + 0.5 - cy).powi(2)).sqrt();
            let px = match d {
                d if d <= r => level.color(),
                d if d <= r + 1.0 => [0xff, 0xff, 0xff, 0xff],
                _ => continue,
            };
            let i = ((y * w + x) * 4) as usize;
            if let Some(dst) = out.get_mut(i..i + 4) {
                dst.copy_from_slice(&px);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn g4_the_badge_takes_the_levels_colour_in_the_corner_only() {
        // spec: G4
        let icon = vec![0u8; 32 * 32 * 4];
        let red = badge(&icon, 32, 32, Level::Critical);
        let px = |v: &[u8], x: usize, y: usize| v[(y * 32 + x) * 4..(y * 32 + x) * 4 + 4].to_vec();
        assert_eq!(px(&red, 25, 25), Level::Critical.color().to_vec());
        assert_eq!(px(&red, 2, 2), vec![0, 0, 0, 0], "the icon itself is untouched");
        assert_eq!(px(&badge(&icon, 32, 32, Level::Ok), 25, 25), Level::Ok.color().to_vec());
        // A short buffer is never written past.
        assert_eq!(badge(&icon[..100], 32, 32, Level::Ok).len(), 100);
    }

    #[tokio::test]
    async fn g4_an_open_breaker_turns_the_tray_red_and_names_the_route() {
        // spec: G4
        let cfg = spillway_policy::Config::parse(
            std::path::Path::new("t.yaml"),
            "channels:\n  - {name: a, format: openai, base_url: 'http://127.0.0.1:9', models: [m]}\n",
            &|_| None,
            &|| unreachable!(),
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ledger = spillway_ledger::Ledger::open_sqlite(&dir.path().join("l.db"))
            .await
            .unwrap();
        let st = AppState::new(cfg, ledger).unwrap();
        assert_eq!(status(&st).0, Level::Ok);
        let route = st.control.route(&st, spillway_wire::Format::OpenAi, "m");
        st.control.force(&st, &route, true, "ops", "drill").await.unwrap();
        let (level, text) = status(&st);
        assert_eq!(level, Level::Critical);
        assert!(text.contains("Breaker open: openai/m"), "{text}");
    }
}
