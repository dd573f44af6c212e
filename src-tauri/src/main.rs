//! The desktop shell: starts the engine in-process (the same config rules as
//! `spillway serve`), opens the console window already connected, and keeps a tray icon
//! whose tooltip says how the gateway is doing. The window loads the engine's own console
//! over loopback, so the browser build and the desktop build are one UI; the web view is
//! granted no IPC at all (capabilities/main.json).

#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

use anyhow::{Context, Result};
use spillway_engine::admin::AdminToken;
use spillway_policy::{Config, LedgerLocation};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tauri::tray::TrayIconBuilder;
use tauri::{Manager, WebviewUrl, WebviewWindowBuilder};

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

struct Engine {
    running: spillway_engine::Running,
    url: String,
    token: AdminToken,
    _demo: Option<spillway_engine::embedded::Embedded>,
    _traffic: Option<tokio::task::JoinHandle<()>>,
}

/// `SPILLWAY_CONFIG` names a config file; without it, the embedded default with demo
/// traffic, as `spillway serve --demo-traffic` runs it.
async fn start_engine() -> Result<Engine> {
    let data_dir = spillway_engine::data_dir()?;
    let (cfg, demo) = match env("SPILLWAY_CONFIG") {
        Some(path) => {
            let path = PathBuf::from(path);
            let text =
                std::fs::read_to_string(&path).with_context(|| format!("cannot read config {}", path.display()))?;
            (
                Config::parse(&path, &text, &env).map_err(|e| anyhow::anyhow!("invalid config:\n{e}"))?,
                None,
            )
        }
        None => {
            let e = spillway_engine::embedded::build(&env).await?;
            (e.config.clone(), Some(e))
        }
    };
    let ledger_path = match &cfg.ledger {
        Some(LedgerLocation::Sqlite(p)) => p.clone(),
        None => data_dir.join("ledger.db"),
    };
    let token = spillway_engine::admin_token()?;
    // Port 0: a desktop app must not fail because 8787 is taken by a headless gateway.
    let listen = Some(
        env("SPILLWAY_LISTEN")
            .and_then(|l| l.parse().ok())
            .unwrap_or(([127, 0, 0, 1], 0).into()),
    );
    let opts = spillway_engine::Options {
        ledger_path,
        listen,
        admin_token: Some(token.clone()),
        ui_dir: spillway_engine::console_dir(None),
    };
    let running = spillway_engine::start(cfg, opts).await?;
    let url = format!("http://{}", running.addr);
    let traffic = demo
        .as_ref()
        .map(|e| spillway_engine::embedded::demo_traffic(url.clone(), e, 4.0));
    Ok(Engine {
        running,
        url,
        token,
        _demo: demo,
        _traffic: traffic,
    })
}

fn health_text(state: &spillway_engine::AppState) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let h = state.metrics.headline(now);
    let errors = h
        .error_rate
        .map(|r| format!("{:.1} % errors", r * 100.0))
        .unwrap_or_else(|| "no traffic yet".into());
    format!(
        "Spillway — {:.1} req/s, {errors}, {} in flight",
        h.requests_per_s, h.in_flight
    )
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let engine = rt.block_on(start_engine())?;
    let url = format!("{}/#token={}", engine.url, engine.token.secret());
    let state = engine.running.state.clone();
    println!("spillway desktop: engine on {}", engine.url);
    let engine = Arc::new(std::sync::Mutex::new(Some(engine)));
    let rt_handle = rt.handle().clone();

    let alerts = state.alerts.subscribe();
    let app = tauri::Builder::default()
        .plugin(tauri_plugin_notification::init())
        .setup(move |app| {
            // Operator alerts (a rejected channel credential today, breaker openings next)
            // become native notifications; without a notification service they are logged.
            let handle = app.handle().clone();
            let mut alerts = alerts;
            rt_handle.spawn(async move {
                use tauri_plugin_notification::NotificationExt;
                loop {
                    match alerts.recv().await {
                        Ok(a) => {
                            if let Err(e) = handle.notification().builder().title(&a.title).body(&a.body).show() {
                                tracing::warn!(error = %e, "could not show a desktop notification");
                            }
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    }
                }
            });
            let target = url.parse().map_err(|e| anyhow::anyhow!("bad console url: {e}"))?;
            WebviewWindowBuilder::new(app, "main", WebviewUrl::External(target))
                .title("Spillway")
                .inner_size(1400.0, 900.0)
                .build()?;
            let icon = app.default_window_icon().cloned();
            let mut tray = TrayIconBuilder::with_id("health").tooltip(health_text(&state));
            if let Some(icon) = icon {
                tray = tray.icon(icon);
            }
            let tray = tray.build(app)?;
            let handle = app.handle().clone();
            let st = state.clone();
            std::thread::spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_secs(2));
                    let text = health_text(&st);
                    let tray = tray.clone();
                    if handle
                        .run_on_main_thread(move || {
                            let _ = tray.set_tooltip(Some(&text));
                        })
                        .is_err()
                    {
                        return;
                    }
                }
            });
            let _ = app.get_webview_window("main").map(|w| w.set_focus());
            Ok(())
        })
        .build(tauri::generate_context!())
        .context("cannot start the desktop window")?;

    app.run(move |_, event| {
        if let tauri::RunEvent::Exit = event
            && let Some(e) = engine.lock().ok().and_then(|mut g| g.take())
        {
            // Drain in-flight requests and flush the ledger before the process goes.
            let _ = rt.block_on(e.running.shutdown());
        }
    });
    Ok(())
}
