//! The seckill example's app: its endpoints, and its invariants under the demo burst.

#[path = "../examples/seckill/app.rs"]
mod app;

use std::sync::Arc;

use app::{MemoryStore, Settings, Store};
use axum::body::Body;
use http::{Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_lock::{LockClient, MemoryBackend};

fn memory_app(stock: i64) -> (axum::Router, Arc<dyn Store>, MemoryBackend) {
    let backend = MemoryBackend::new();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::with_voucher(1, stock));
    let app = app::app(
        LockClient::new(backend.clone()),
        store.clone(),
        Settings::default(),
    )
    .unwrap();
    (app, store, backend)
}

async fn send(
    app: &axum::Router,
    method: Method,
    uri: &str,
    user: Option<&str>,
) -> (StatusCode, serde_json::Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(user) = user {
        req = req.header("x-user-id", user);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = res.status();
    if status == StatusCode::TOO_MANY_REQUESTS {
        assert!(res.headers().contains_key(header::RETRY_AFTER));
    }
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or_default())
}

#[tokio::test]
async fn endpoints_answer_as_documented() {
    let (app, _, backend) = memory_app(1);
    let post = Method::POST;
    let (s, order) = send(&app, post.clone(), "/vouchers/1/orders", Some("42")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(
        (order["user_id"].as_u64(), order["voucher_id"].as_u64()),
        (Some(42), Some(1))
    );
    assert!(order["fencing_token"].as_u64().unwrap() > 0);

    let (s, e) = send(&app, post.clone(), "/vouchers/1/orders", Some("42")).await;
    assert_eq!(
        (s, e["error"].as_str()),
        (StatusCode::CONFLICT, Some("duplicate_order"))
    );
    let (s, e) = send(&app, post.clone(), "/vouchers/1/orders", Some("43")).await;
    assert_eq!(
        (s, e["error"].as_str()),
        (StatusCode::CONFLICT, Some("sold_out"))
    );
    let (s, e) = send(&app, post.clone(), "/vouchers/1/orders", None).await;
    assert_eq!(
        (s, e["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("bad_request"))
    );
    let (s, _) = send(&app, post.clone(), "/vouchers/1/orders", Some("4x")).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = send(&app, post.clone(), "/vouchers/1/orders", Some("-1")).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, e) = send(&app, post, "/vouchers/9/orders", Some("44")).await;
    assert_eq!(
        (s, e["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );

    let (s, v) = send(&app, Method::GET, "/vouchers/1", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        (v["stock"].as_i64(), v["orders"].as_u64()),
        (Some(0), Some(1))
    );
    let (s, _) = send(&app, Method::GET, "/vouchers/2", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(backend.is_empty(), "every lock released");
}

/// The demo's burst — 300 users × 5 concurrent identical requests over real HTTP/1
/// connections against 100 in stock — keeps every invariant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_burst_keeps_the_invariants() {
    let (app, store, backend) = memory_app(100);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let tally = app::burst(addr, 1, 300, 5, 250).await.unwrap();
    server.abort();
    let verdict = app::verdict(store.as_ref(), 1, 100, &tally).await.unwrap();
    assert!(verdict.held(), "{verdict:?}\n{}", app::table(&tally));
    assert_eq!(tally.requests, 1500);
    assert_eq!(tally.other, 0, "{tally:?}");
    assert_eq!(
        tally.created + tally.duplicates + tally.busy + tally.sold_out,
        tally.requests
    );
    // 300 users for 100 units: every unit sells, each to one user.
    assert_eq!(
        (tally.created, tally.stock_left, tally.orders),
        (100, 0, 100)
    );
    assert!(backend.is_empty(), "no lock left behind");
}
