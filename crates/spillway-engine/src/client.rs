//! The HTTP client every call to a channel goes through (attempts and stored-response
//! follow-ups): TCP with no delay, keepalive and a bounded connect; rustls on aws-lc-rs
//! with the platform's roots, HTTP/2 where ALPN offers it; a pool of idle connections.
//! Nothing else: no redirects (one would carry the channel's key and the prompt to
//! whatever host it names), no proxy (a gateway on a workstation must not send prompts
//! through whatever proxy the desktop session configures), no decompression, no cookies.
//!
//! It is hyper's own client rather than reqwest, which wraps the same one: reqwest's
//! layers (its redirect policy, which parses the URL again even with redirects off, its
//! pending-request state and a second URL parse there) took about 5 % of a request's CPU
//! in a closed-loop profile, and the gateway used none of what they do. reqwest stays for
//! the calls off the request path (alert webhooks, the simulator's control API).

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

/// A request's body: the whole of it, in memory (the gateway has read it already).
pub type Body = Full<Bytes>;
/// What a channel answers: its headers, and a body still to be read.
pub type Response = http::Response<hyper::body::Incoming>;

/// The client to channels. Cloning shares its pool.
#[derive(Clone)]
pub struct UpstreamClient {
    inner: Client<Bounded<HttpsConnector<HttpConnector>>, Body>,
}

type BoxError = Box<dyn StdError + Send + Sync>;

/// A connector whose connections must be ready (TCP connected and, for https, the TLS
/// handshake done) within `limit`: `upstream.connect_timeout_ms` is "connecting to a
/// provider", and a peer that accepts TCP and then says nothing must not hold an attempt
/// until its first-byte timeout.
#[derive(Clone)]
struct Bounded<C> {
    inner: C,
    limit: Duration,
}

impl<C> tower::Service<http::Uri> for Bounded<C>
where
    C: tower::Service<http::Uri>,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let limit = self.limit;
        // Boxed once per new connection, not per request.
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(done) => done.map_err(Into::into),
                Err(_) => Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "not connected within {} ms (upstream.connect_timeout_ms)",
                        limit.as_millis()
                    ),
                )) as BoxError),
            }
        })
    }
}

/// How long an idle pooled connection is kept.
const POOL_IDLE: Duration = Duration::from_secs(60);

/// At most this many idle connections per host: each holds about 26 KiB (hyper's read and
/// write buffers, its request channel), and a burst that waited on the ledger sends all at
/// once, so 512 of them stayed open for the minute after it; connections in use are not
/// capped.
const POOL_MAX_IDLE_PER_HOST: usize = 128;

/// The TLS every outgoing call uses, the upstream client's and reqwest's alike (one set of
/// roots read once: the platform's bundle parsed is a few hundred KiB): rustls on
/// aws-lc-rs, the platform's verifier (reqwest's own choice), trusting the platform's
/// roots and `extra` (tests: a loopback server's own CA).
pub fn tls_config(extra: Vec<rustls::pki_types::CertificateDer<'static>>) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = if extra.is_empty() {
        rustls_platform_verifier::Verifier::new(provider.clone())
    } else {
        rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider.clone())
    }
    .map_err(|e| format!("cannot load the platform's TLS roots: {e}"))?;
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("cannot set up TLS: {e}"))?
        .dangerous()
        // Not dangerous: the platform's own verifier, as reqwest and browsers use it.
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}

impl UpstreamClient {
    /// A client on `tls` ([`tls_config`]).
    pub fn new(connect_timeout: Duration, keepalive: Duration, tls: rustls::ClientConfig) -> UpstreamClient {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_keepalive(Some(keepalive));
        // https:// URLs go through the same connector, to the TLS layer around it.
        http.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            // Plain http:// only where the config allowed it (this machine, or
            // `allow_plain_http`).
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        let bounded = Bounded {
            inner: https,
            limit: connect_timeout,
        };
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(bounded);
        UpstreamClient { inner }
    }

    /// Sends `req` (an absolute URI) and waits for the answer's headers. The caller bounds
    /// the wait.
    pub async fn send(&self, req: http::Request<Body>) -> Result<Response, hyper_util::client::legacy::Error> {
        self.inner.request(req).await
    }
}

/// An error and every cause under it, as one line ("client error (Connect): tcp connect
/// error: Connection refused (os error 111)"). hyper's errors say little on their own:
/// the cause is what an operator needs. None of them carries the URL, whose query is the
/// client's own text.
pub fn describe(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        // Some wrappers print their cause themselves.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// Whether `e` or a cause under it is a timeout (the bounded connect).
pub fn is_timeout(e: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// The `Authorization`-like header carrying a channel's key, marked sensitive (never
/// indexed by HTTP/2's header compression, never printed by hyper). `None` if the key
/// holds a byte no header can carry (a line break from a pasted file, say); the error
/// names neither the key nor any part of it.
pub fn key_header(format: spillway_wire::Format, key: &str) -> Result<(http::HeaderName, http::HeaderValue), String> {
    use spillway_wire::Format;
    let (name, value) = match format {
        Format::OpenAi => (http::header::AUTHORIZATION, format!("Bearer {key}")),
        Format::Anthropic => (http::HeaderName::from_static("x-api-key"), key.to_owned()),
        Format::Gemini => (http::HeaderName::from_static("x-goog-api-key"), key.to_owned()),
    };
    let mut value = http::HeaderValue::try_from(value).map_err(|_| {
        "the channel's API key holds a character an HTTP header cannot carry (a line break?)".to_owned()
    })?;
    value.set_sensitive(true);
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_reads_with_its_causes_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        #[derive(Debug)]
        struct Wrap(std::io::Error, &'static str);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.1)
            }
        }
        impl StdError for Wrap {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let e = Wrap(io, "tcp connect error");
        assert_eq!(describe(&e), "tcp connect error: Connection refused");
        assert!(!is_timeout(&e));
        let echo = Wrap(std::io::Error::other("x"), "tcp connect error: x");
        assert_eq!(describe(&echo), "tcp connect error: x");
        let slow = Wrap(std::io::Error::new(std::io::ErrorKind::TimedOut, "t"), "connect");
        assert!(is_timeout(&slow));
    }

    #[test]
    fn a_key_header_is_sensitive_and_a_bad_key_is_not_quoted() {
        // spec: P3
        let (name, value) = key_header(spillway_wire::Format::OpenAi, "sk-abc").unwrap();
        assert_eq!(
            (name.as_str(), value.to_str().unwrap()),
            ("authorization", "Bearer sk-abc")
        );
        assert!(value.is_sensitive());
        let (name, _) = key_header(spillway_wire::Format::Gemini, "g").unwrap();
        assert_eq!(name.as_str(), "x-goog-api-key");
        let err = key_header(spillway_wire::Format::Anthropic, "sk-secret\n").unwrap_err();
        assert!(!err.contains("sk-secret"), "{err}");
    }
}

#[cfg(test)]
mod tls_tests {
    use super::*;
    use http_body_util::BodyExt;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    const CA: &[u8] = include_bytes!("../testdata/tls/ca.pem");
    const LEAF: &[u8] = include_bytes!("../testdata/tls/leaf.pem");
    const LEAF_KEY: &[u8] = include_bytes!("../testdata/tls/leaf.key");

    /// A loopback HTTPS server offering `alpn`, answering each request with its protocol
    /// version, path and query, and whether it carried an `authorization` header.
    async fn server(alpn: &[&[u8]]) -> (u16, tokio::task::JoinHandle<()>) {
        let certs = vec![CertificateDer::from_pem_slice(LEAF).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(LEAF_KEY).unwrap();
        let mut cfg =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(certs, key)
                .unwrap();
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            // Bounded: the test makes a handful of connections, then aborts the task.
            for _ in 0..16 {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A client that refuses the certificate ends the handshake.
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let svc = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                        let text = format!(
                            "{:?} {} auth={}",
                            req.version(),
                            req.uri().path_and_query().map(|p| p.as_str()).unwrap_or(""),
                            req.headers().contains_key(http::header::AUTHORIZATION)
                        );
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(text))))
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        (port, task)
    }

    fn client(extra: Vec<CertificateDer<'static>>) -> UpstreamClient {
        UpstreamClient::new(
            Duration::from_secs(5),
            Duration::from_secs(30),
            tls_config(extra).unwrap(),
        )
    }

    fn trusting() -> UpstreamClient {
        client(vec![CertificateDer::from_pem_slice(CA).unwrap()])
    }

    async fn get(client: &UpstreamClient, url: &str) -> Result<String, String> {
        let mut req = http::Request::new(Body::new(Bytes::new()));
        *req.uri_mut() = url.parse().unwrap();
        let (name, value) = key_header(spillway_wire::Format::OpenAi, "sk-test").unwrap();
        req.headers_mut().insert(name, value);
        let send = tokio::time::timeout(Duration::from_secs(10), client.send(req)).await;
        let resp = send.map_err(|_| "timed out".to_owned())?.map_err(|e| describe(&e))?;
        let body = resp.into_body().collect().await.map_err(|e| describe(&e))?.to_bytes();
        Ok(String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn an_https_channel_gets_http2_where_it_offers_it_and_http1_where_not() {
        let client = trusting();
        let (h2, a) = server(&[b"h2", b"http/1.1"]).await;
        let said = get(&client, &format!("https://localhost:{h2}/v1/chat/completions?x=1")).await;
        assert_eq!(said.as_deref(), Ok("HTTP/2.0 /v1/chat/completions?x=1 auth=true"));
        let (h1, b) = server(&[b"http/1.1"]).await;
        let said = get(&client, &format!("https://127.0.0.1:{h1}/v1/messages")).await;
        assert_eq!(said.as_deref(), Ok("HTTP/1.1 /v1/messages auth=true"));
        a.abort();
        b.abort();
    }

    #[tokio::test]
    async fn a_certificate_the_platform_does_not_trust_is_refused() {
        let (port, task) = server(&[b"h2", b"http/1.1"]).await;
        let client = client(Vec::new());
        let err = get(&client, &format!("https://localhost:{port}/v1/models"))
            .await
            .unwrap_err();
        // The cause, not hyper's bare "client error (Connect)".
        assert!(err.contains("certificate"), "{err}");
        assert!(!err.contains("sk-test"), "{err}");
        task.abort();
    }

    #[tokio::test]
    async fn a_peer_that_accepts_and_says_nothing_is_a_connect_timeout() {
        // Accepts TCP, never answers the TLS handshake; held until the test ends.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            for _ in 0..4 {
                let Ok((tcp, _)) = listener.accept().await else { return };
                open.push(tcp);
            }
            std::future::pending::<()>().await;
        });
        let tls = tls_config(vec![CertificateDer::from_pem_slice(CA).unwrap()]).unwrap();
        let client = UpstreamClient::new(Duration::from_millis(200), Duration::from_secs(30), tls);
        let mut req = http::Request::new(Body::new(Bytes::new()));
        *req.uri_mut() = format!("https://localhost:{port}/v1/models").parse().unwrap();
        let started = std::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(10), client.send(req))
            .await
            .expect("the connect bound ends the call")
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(is_timeout(&err), "{}", describe(&err));
        assert!(
            describe(&err).contains("not connected within 200 ms"),
            "{}",
            describe(&err)
        );
        held.abort();
    }

    #[tokio::test]
    async fn a_refused_connect_says_so() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let client = trusting();
        let err = get(&client, &format!("http://127.0.0.1:{port}/v1/models"))
            .await
            .unwrap_err();
        assert!(err.starts_with("client error (Connect)"), "{err}");
        assert!(err.to_lowercase().contains("refused"), "{err}");
    }
}
