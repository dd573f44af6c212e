//! The console's static files, served at `/`: from the files compiled into the binary
//! (the `spillway` binary embeds `ui/dist`), or from a directory given for development.
//! Client-side routes get `index.html`; nothing outside the console's own files is ever
//! read, whatever the path says.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

/// Looks a console file up by its path relative to the console's root (`index.html`,
/// `assets/app-1234.js`).
pub type Assets = Arc<dyn Fn(&str) -> Option<Cow<'static, [u8]>> + Send + Sync>;

/// Where the console's files come from.
#[derive(Clone, Default)]
pub enum Console {
    /// No console: the admin API works, `/` says how to get the console.
    #[default]
    None,
    /// Files compiled into the binary.
    Embedded(Assets),
    /// A built console on disk (`--ui-dir`), read at each request: for development.
    Dir(PathBuf),
}

/// P5-style headers on the console's own pages: nothing loads from elsewhere.
pub const CSP: &str = "default-src 'self'; connect-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; \
    script-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

/// The file a URL path names, relative to the console's root, or `None` when the path
/// tries to leave it. Percent-encoding is decoded first, so `%2e%2e` is `..` here too.
pub fn relative_path(path: &str) -> Option<String> {
    let decoded = percent_decode(path)?;
    let rel = decoded.trim_start_matches('/');
    let bad = rel
        .split('/')
        .any(|seg| seg == ".." || seg == "." || seg.starts_with('.') || seg.contains(['\\', '\0', ':']));
    (!bad).then(|| rel.to_owned())
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn mime(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, e)| e) {
        Some("html") => "text/html; charset=utf-8",
        Some("js") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("json") => "application/json",
        Some("woff2") => "font/woff2",
        _ => "application/octet-stream",
    }
}

fn not_built() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(serde_json::json!({"error": "This gateway was built without its console. Build it with `make run` (it builds ui/ first), or pass --ui-dir."})),
    )
        .into_response()
}

impl Console {
    async fn read(&self, rel: &str) -> Option<Cow<'static, [u8]>> {
        match self {
            Console::None => None,
            Console::Embedded(assets) => assets(rel),
            Console::Dir(dir) => {
                let p = dir.join(rel);
                if !p.is_file() {
                    return None;
                }
                tokio::fs::read(p).await.ok().map(Cow::Owned)
            }
        }
    }

    /// The response for a GET of `path`.
    pub async fn serve(&self, path: &str) -> Response {
        if matches!(self, Console::None) {
            return not_built();
        }
        let Some(rel) = relative_path(path) else {
            return (StatusCode::NOT_FOUND, "not found").into_response();
        };
        let rel = if rel.is_empty() { "index.html".to_owned() } else { rel };
        let (name, bytes) = match self.read(&rel).await {
            Some(b) => (rel, b),
            // A missing asset is a 404, not the page: a stale tab must not run HTML as JS.
            None if rel.starts_with("assets/") => return (StatusCode::NOT_FOUND, "not found").into_response(),
            // Client-side routes (`/ledger/...`) are the single page.
            None => match self.read("index.html").await {
                Some(b) => ("index.html".to_owned(), b),
                None => return not_built(),
            },
        };
        let mut resp = Response::new(Body::from(bytes));
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(mime(&name)));
        h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
        h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
        h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
        h.insert("x-frame-options", HeaderValue::from_static("DENY"));
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_cannot_leave_the_console() {
        assert_eq!(relative_path("/").as_deref(), Some(""));
        assert_eq!(relative_path("/assets/app.js").as_deref(), Some("assets/app.js"));
        assert_eq!(
            relative_path("/ledger/some/route").as_deref(),
            Some("ledger/some/route")
        );
        for bad in [
            "/../etc/passwd",
            "/%2e%2e/%2e%2e/etc/passwd",
            "/%2E%2E/x",
            "/assets/..%2f..%2fetc/passwd",
            "/.env",
            "/a/%00/b",
            "/a\\..\\b",
            "/%zz",
            "/C:/windows",
        ] {
            assert_eq!(relative_path(bad), None, "{bad}");
        }
    }
}
