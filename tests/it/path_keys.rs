//! Path keys under `Router::layer`, over real connections (HTTP/1.1 and HTTP/2): the
//! layer wraps the router's fallback and every method router's 405 too, and must answer
//! those as axum does instead of as a misconfiguration (issue 24, item 8).

use std::net::SocketAddr;

use axum::Router;
use axum::extract::Path;
use axum::routing::{get, post};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use tower_lock::layer::{LockLayer, PathParamKey, key_from};
use tower_lock::{LockClient, LockKey, MemoryBackend};

use crate::common::http::{Proto, exchange};
use crate::common::serve;

/// One request on a fresh connection: the status, the `allow` header and the body.
async fn send(
    addr: SocketAddr,
    proto: Proto,
    method: Method,
    path: &str,
) -> (StatusCode, Option<String>, String) {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    let req = req.body(Empty::<Bytes>::new()).unwrap();
    let res: Response<Incoming> = exchange(addr, proto, req).await;
    let status = res.status();
    let allow = res
        .headers()
        .get(header::ALLOW)
        .map(|v| v.to_str().unwrap().to_owned());
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, allow, String::from_utf8(body.to_vec()).unwrap())
}

/// What plain axum answers, without the layer: the reference.
fn routes() -> Router {
    Router::new()
        .route("/accounts/{id}", post(|| async { "ordered" }))
        .route("/health", get(|| async { "ok" }))
}

/// Regression: under `Router::layer` a `PathParamKey` turned axum's 404 for an unknown
/// path into a 500. It answers 404 with axum's empty body, and a known path with a
/// method it does not serve gets axum's 405 with `allow`, over HTTP/1.1 and HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_key_under_router_layer_answers_404_and_405_as_axum_does() {
    let store = MemoryBackend::new();
    let client = LockClient::new(store.clone());
    let keys = PathParamKey::new("id").namespace("account").unwrap();
    let plain = serve(routes()).await;
    let layered = serve(routes().layer(LockLayer::new(client.clone(), keys))).await;
    for proto in [Proto::Http1, Proto::Http2] {
        for (method, path) in [(Method::GET, "/nowhere"), (Method::POST, "/accounts/7/x")] {
            let expected = send(plain.addr, proto, method.clone(), path).await;
            assert_eq!(expected.0, StatusCode::NOT_FOUND);
            assert_eq!(
                send(layered.addr, proto, method, path).await,
                expected,
                "{proto:?} {path}"
            );
        }
        let expected = send(plain.addr, proto, Method::GET, "/accounts/7").await;
        assert_eq!(expected.0, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(
            send(layered.addr, proto, Method::GET, "/accounts/7").await,
            expected,
            "{proto:?}: 405 with axum's `allow`"
        );
        assert_eq!(
            send(layered.addr, proto, Method::POST, "/accounts/7")
                .await
                .0,
            StatusCode::OK
        );
    }
    assert!(store.is_empty(), "nothing left locked");
}

/// Regression: `key_from(|Path(id)| ...)` under `Router::layer` answered an unknown path
/// with axum's internal 500 text ("Wrong number of path arguments..." / "No paths
/// parameters found..."). An unknown path is a 404; a known route without the
/// parameter is a wiring mistake, a 500 whose text is generic (the details are logged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_extractor_key_under_router_layer_leaks_no_axum_message() {
    let client = LockClient::new(MemoryBackend::new());
    let keys = key_from(|Path(id): Path<u64>| LockKey::namespaced("account", &id.to_string()));
    let layered = serve(routes().layer(LockLayer::new(client, keys))).await;
    for proto in [Proto::Http1, Proto::Http2] {
        assert_eq!(
            send(layered.addr, proto, Method::GET, "/nowhere").await,
            (StatusCode::NOT_FOUND, None, String::new()),
            "{proto:?}"
        );
        let (status, _, body) = send(layered.addr, proto, Method::GET, "/health").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{proto:?}");
        assert!(
            !body.contains("path argument") && !body.contains("Path"),
            "axum's message leaked: {body}"
        );
        assert_eq!(
            send(layered.addr, proto, Method::POST, "/accounts/7")
                .await
                .0,
            StatusCode::OK
        );
        // A client's bad value stays axum's 400, as it is.
        let (status, _, body) = send(layered.addr, proto, Method::POST, "/accounts/x").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{proto:?}: {body}");
    }
}
