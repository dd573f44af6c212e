//! The desktop shell: starts the engine in-process (the start-up path of `spillway serve`,
//! from spillway-cli's library), opens the console window already connected, and keeps a tray icon
//! whose colour and tooltip say how the gateway is doing. The window loads the engine's own console
//! over loopback, so the browser build and the desktop build are one UI; the web view is
//! granted no IPC at all (capabilities/main.json).

#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

use anyhow::{Context, Result};
use spillway_cli::launch::{Launch, Launched, launch};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tauri::tray::TrayIconBuilder;
use tauri::{Manager, WebviewUrl, WebviewWindowBuilder};

/// The engine's allocator, as in `spillway serve` (see spillway-cli's main): a request
/// allocates and frees many small objects, some on another thread than made them.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The same start-up path as `spillway serve`: `SPILLWAY_CONFIG` names a config file;
/// without it, the embedded default. Demo traffic goes to the config's simulated channels,
/// if it has any. The gateway listens on a free loopback port (a desktop app must not
/// fail because 8787 is taken by a headless one).
async fn start_engine() -> Result<Launched> {
    let config = env("SPILLWAY_CONFIG").map(PathBuf::from);
    let demo_traffic = Some(4.0);
    let listen = Some(
        env("SPILLWAY_LISTEN")
            .and_then(|l| l.parse().ok())
            .unwrap_or(([127, 0, 0, 1], 0).into()),
    );
    Ok(launch(Launch {
        config,
        listen,
        demo_traffic,
        ..Launch::default()
    })
    .await?)
}

fn main() -> Result<()> {
    spillway_cli::memory::no_huge_pages();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    // The same request threads as `spillway serve` (SPILLWAY_WORKERS, or the same default).
    let asked = env("SPILLWAY_WORKERS")
        .map(|v| spillway_cli::launch::parse_workers(&v))
        .transpose()
        .map_err(|e| anyhow::anyhow!("SPILLWAY_WORKERS: {e}"))?;
    // The same runtime as `spillway serve`: its request threads, and the hook that gives
    // freed memory back once a thread goes idle.
    let rt = spillway_cli::memory::runtime(spillway_cli::launch::request_threads(
        asked,
        spillway_cli::launch::sqlite_ledger(env("SPILLWAY_CONFIG").map(PathBuf::from).as_deref(), None),
    ))?;
    let engine = rt.block_on(start_engine())?;
    let url = format!("{}/#token={}", engine.url, engine.token.secret());
    let state = engine.running.state.clone();
    println!("spillway desktop: engine on {}", engine.url);
    let engine = Arc::new(std::sync::Mutex::new(Some(engine)));
    let rt_handle = rt.handle().clone();

    let alerts = state.alerts.subscribe();
    // SIGINT/SIGTERM as `spillway serve` takes them: the first exits the app (through the
    // same drain as Quit), a second cuts the drain short.
    let mut signals = rt.block_on(async { spillway_cli::signals::Signals::new() })?;
    let abort_now = Arc::new(tokio::sync::Notify::new());
    let abort_signal = abort_now.clone();
    let app = tauri::Builder::default()
        .plugin(tauri_plugin_notification::init())
        .setup(move |app| {
            let handle = app.handle().clone();
            rt_handle.spawn(async move {
                signals.next().await;
                handle.exit(0);
                signals.next().await;
                abort_signal.notify_one();
            });
            // Operator alerts (a refused channel credential, a breaker opening or closing, a
            // channel leaving rotation) become native notifications; without a notification
            // service they are logged.
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
            // Owned, so the tray thread can redraw it for as long as the app runs.
            let icon = app
                .default_window_icon()
                .map(|i| (i.rgba().to_vec(), i.width(), i.height()));
            // Quit goes through the same shutdown as closing the window (RunEvent::Exit).
            let quit = tauri::menu::MenuItem::with_id(app, "quit", "Quit Spillway", true, None::<&str>)?;
            let menu = tauri::menu::Menu::with_items(app, &[&quit])?;
            let (level, text) = spillway_cli::status::status(&state);
            let mut tray = TrayIconBuilder::with_id("health")
                .tooltip(text)
                .menu(&menu)
                .on_menu_event(|app, event| {
                    if event.id() == "quit" {
                        app.exit(0);
                    }
                });
            // G4: the icon carries a dot of the gateway's colour: red while a breaker is
            // open (or the ledger refuses writes), amber while one is on probation or a
            // channel is out of rotation, green otherwise.
            let badged = move |level| {
                icon.as_ref().map(|(rgba, w, h)| {
                    tauri::image::Image::new_owned(spillway_cli::status::badge(rgba, *w, *h, level), *w, *h)
                })
            };
            if let Some(i) = badged(level) {
                tray = tray.icon(i);
            }
            let tray = tray.build(app)?;
            let handle = app.handle().clone();
            let st = state.clone();
            std::thread::spawn(move || {
                let mut shown = level;
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                    let (level, text) = spillway_cli::status::status(&st);
                    let icon = (level != shown).then(|| badged(level)).flatten();
                    shown = level;
                    let tray = tray.clone();
                    if handle
                        .run_on_main_thread(move || {
                            let _ = tray.set_tooltip(Some(&text));
                            if let Some(i) = icon {
                                let _ = tray.set_icon(Some(i));
                            }
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
            // What `spillway serve` does on its first signal: drain in-flight requests
            // within the drain deadline, cut and record what is left, flush the ledger; a
            // second signal meanwhile cuts at once.
            let r = rt.block_on(async {
                tokio::select! {
                    r = e.shutdown() => r,
                    _ = abort_now.notified() => e.abort().await,
                }
            });
            if let Err(err) = r {
                tracing::error!(error = %err, "shutdown did not complete cleanly");
            }
        }
    });
    Ok(())
}
