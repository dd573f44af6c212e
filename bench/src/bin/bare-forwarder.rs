//! The yardstick `make bench` holds the gateway to: the least a forwarding proxy can do.
//! Every request goes to the upstream named on the command line, path and headers as they
//! came, and the answer streams back as it comes: no parsing, no ledger, no limits. What
//! the gateway spends beyond this is the price of what it does.
//!
//! `bare-forwarder --upstream http://127.0.0.1:PORT` prints `bare-forwarder listening on
//! http://ADDR` once it accepts connections.

use hyper::body::Incoming;
use hyper::{Request, Response, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

/// The gateway's allocator, so that an allocation costs both the same (the gateway's
/// idle-time `mi_collect` and transparent-huge-page switch are left out: this process
/// keeps nothing between requests but its pool).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Upstream = Client<HttpConnector, Incoming>;

async fn forward(client: Upstream, base: Uri, mut req: Request<Incoming>) -> Result<Response<Incoming>, String> {
    let path = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let uri = Uri::builder()
        .scheme(base.scheme_str().unwrap_or("http"))
        .authority(base.authority().map(|a| a.as_str()).unwrap_or_default())
        .path_and_query(path)
        .build()
        .map_err(|e| e.to_string())?;
    *req.uri_mut() = uri;
    req.headers_mut().remove(hyper::header::HOST);
    client.request(req).await.map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let base: Uri = match (args.next().as_deref(), args.next()) {
        (Some("--upstream"), Some(u)) => u.parse()?,
        _ => return Err("usage: bare-forwarder --upstream http://HOST:PORT".into()),
    };
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("bare-forwarder listening on http://{}", listener.local_addr()?);
    loop {
        let (sock, _) = listener.accept().await?;
        let _ = sock.set_nodelay(true);
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| forward(client.clone(), base.clone(), req));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(sock), svc)
                .await;
        });
    }
}
