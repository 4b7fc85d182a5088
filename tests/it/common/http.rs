//! A real HTTP client for the tests: one request on a fresh connection, over HTTP/1.1 or
//! HTTP/2 with prior knowledge.

use std::net::SocketAddr;

use http::{HeaderValue, Request, Response, header};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// Which protocol a request goes over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Http1,
    /// HTTP/2 with prior knowledge (no upgrade).
    Http2,
}

/// Both protocols, for tests that run each case over each.
pub const PROTOS: [Proto; 2] = [Proto::Http1, Proto::Http2];

/// Sends `req` on a fresh connection to `addr` and returns the response as soon as its
/// head has arrived; the body is still on its way. Over HTTP/1.1 a request without a
/// `Host` gets `addr`'s.
pub async fn exchange<B>(addr: SocketAddr, proto: Proto, mut req: Request<B>) -> Response<Incoming>
where
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if proto == Proto::Http1 && !req.headers().contains_key(header::HOST) {
        let host = HeaderValue::from_str(&addr.to_string()).unwrap();
        req.headers_mut().insert(header::HOST, host);
    }
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    match proto {
        Proto::Http1 => {
            let (mut sender, conn) = http1::handshake(TokioIo::new(tcp)).await.unwrap();
            tokio::spawn(conn);
            sender.send_request(req).await.unwrap()
        }
        Proto::Http2 => {
            let (mut sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
            tokio::spawn(conn);
            sender.send_request(req).await.unwrap()
        }
    }
}
