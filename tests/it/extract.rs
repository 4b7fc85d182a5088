//! The axum extractors `HeldLock` and `Locks`, and the ready-made key extractors on a
//! real axum router.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::routing::{get, post};
use http::{HeaderName, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_lock::extract::{HeldLock, Locks};
use tower_lock::layer::{ExtensionKey, HeaderKey, LockLayer, PathParamKey};
use tower_lock::{ConfigError, Lease, LockClient, LockKey, MemoryBackend, Owner};

const USER: HeaderName = HeaderName::from_static("x-user-id");

async fn call(app: &Router, method: &str, uri: &str, user: Option<&str>) -> (StatusCode, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(user) = user {
        req = req.header(USER, user);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

async fn describe(held: HeldLock) -> String {
    assert_eq!(Owner::current().as_ref(), Some(held.owner()));
    assert!(!held.is_lost());
    format!(
        "{} {} {}",
        held.keys()
            .iter()
            .map(LockKey::as_str)
            .collect::<Vec<_>>()
            .join(","),
        held.mode(),
        held.fencing_tokens().len()
    )
}

async fn maybe(held: Option<HeldLock>) -> String {
    held.map_or_else(|| "none".to_owned(), |h| h.key().to_string())
}

#[tokio::test]
async fn held_lock_describes_the_requests_lock() {
    let backend = MemoryBackend::new();
    let app = Router::new()
        .route("/held", post(describe))
        .route("/maybe", post(maybe))
        .layer(LockLayer::new(
            backend.clone(),
            HeaderKey::new(USER).namespace("user").unwrap().optional(),
        ));
    assert_eq!(
        call(&app, "POST", "/held", Some("9")).await,
        (StatusCode::OK, "user:{9} exclusive 1".into())
    );
    assert_eq!(
        call(&app, "POST", "/maybe", Some("9")).await,
        (StatusCode::OK, "user:{9}".into())
    );
    // The layer is there but this request has no key: no HeldLock.
    assert_eq!(
        call(&app, "POST", "/maybe", None).await,
        (StatusCode::OK, "none".into())
    );
    let (status, body) = call(&app, "POST", "/held", None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        body.contains("is `LockLayer` installed on this route"),
        "{body}"
    );
    assert!(backend.is_empty());
}

#[tokio::test]
async fn without_the_layer_the_extractors_say_what_to_fix() {
    let app = Router::new()
        .route("/held", get(describe))
        .route("/maybe", get(maybe))
        .route("/locks", get(|_: Locks| async { "unreachable" }))
        .route(
            "/opt-locks",
            get(|l: Option<Locks>| async move { format!("{}", l.is_some()) }),
        );
    let (status, body) = call(&app, "GET", "/held", None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        body.contains("is `LockLayer` installed on this route"),
        "{body}"
    );
    let (status, body) = call(&app, "GET", "/locks", None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        body,
        "`Locks` is missing: is `LockLayer` installed on this route?"
    );
    assert_eq!(
        call(&app, "GET", "/maybe", None).await,
        (StatusCode::OK, "none".into())
    );
    assert_eq!(
        call(&app, "GET", "/opt-locks", None).await,
        (StatusCode::OK, "false".into())
    );
}

#[tokio::test]
async fn locks_takes_more_locks_as_the_request_owner() {
    let backend = MemoryBackend::new();
    let b = backend.clone();
    let handler = move |held: HeldLock, locks: Locks| {
        let backend = b.clone();
        async move {
            let again = locks.lock(held.key()).await.unwrap();
            assert_eq!(again.hold_count(), 2);
            assert_eq!(again.fencing_token(), held.fencing_token());
            // A spawned task has no current owner, but `Locks` carries it.
            let side = tokio::spawn({
                let locks = locks.clone();
                async move {
                    locks
                        .try_lock_for("side", Duration::ZERO, Lease::Watchdog)
                        .await
                }
            })
            .await
            .unwrap()
            .unwrap();
            assert_eq!(side.owner(), held.owner());
            assert!(backend.contains_key(&LockKey::new("side").unwrap()));
            drop(side);
            drop(again);
            "ok"
        }
    };
    let app = Router::new()
        .route("/", post(handler))
        .layer(LockLayer::new(backend.clone(), HeaderKey::new(USER)));
    assert_eq!(
        call(&app, "POST", "/", Some("1")).await,
        (StatusCode::OK, "ok".into())
    );
    for _ in 0..100 {
        if backend.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("locks taken through `Locks` were not released");
}

#[tokio::test]
async fn path_parameters_need_route_layer() {
    let backend = MemoryBackend::new();
    let keys = PathParamKey::new("id").namespace("doc").unwrap();
    let routed = Router::new()
        .route("/docs/{id}", post(describe))
        .route_layer(LockLayer::new(backend.clone(), keys.clone()));
    assert_eq!(
        call(&routed, "POST", "/docs/a%7Bb", None).await,
        (StatusCode::OK, "doc:{a%7Bb} exclusive 1".into()),
        "decoded by axum, escaped by the key"
    );

    // `Router::layer` also wraps the fallback, which has no path parameters: an
    // unknown path gets axum's 404 (it got the layer's 500 up to 0.1).
    let layered = Router::new()
        .route("/docs/{id}", post(describe))
        .layer(LockLayer::new(backend.clone(), keys.clone()));
    assert_eq!(
        call(&layered, "POST", "/docs/1", None).await.0,
        StatusCode::OK
    );
    let (status, body) = call(&layered, "POST", "/nowhere", None).await;
    assert_eq!((status, body.as_str()), (StatusCode::NOT_FOUND, ""));
    assert_eq!(
        call(&routed, "POST", "/nowhere", None).await.0,
        StatusCode::NOT_FOUND
    );

    // Wrapped around the whole router it runs before routing: never any parameter.
    let outside = tower::Layer::layer(
        &LockLayer::new(backend.clone(), keys),
        Router::new().route("/docs/{id}", post(describe)),
    );
    let res = outside
        .oneshot(Request::post("/docs/1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);

    let wrong = Router::new()
        .route("/docs/{id}", post(describe))
        .route_layer(LockLayer::new(backend.clone(), PathParamKey::new("name")));
    let (status, body) = call(&wrong, "POST", "/docs/1", None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        !body.contains("no path parameter"),
        "details are logged, not sent: {body}"
    );
    assert!(backend.is_empty());
}

#[derive(Clone)]
struct UserId(u64);

#[tokio::test]
async fn extension_keys_come_from_auth_middleware_and_nested_layers_share_the_owner() {
    let backend = MemoryBackend::new();
    // "Authentication": trusts the header here; a real one checks a token.
    let auth = axum::middleware::map_request(|mut req: Request| async move {
        let user = req
            .headers()
            .get(USER)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        if let Some(user) = user {
            req.extensions_mut().insert(UserId(user));
        }
        req
    });
    let by_user = ExtensionKey::new(|u: &UserId| u.0.to_string())
        .namespace("user")
        .unwrap();
    let by_doc = PathParamKey::new("id").namespace("doc").unwrap();
    let handler = |held: HeldLock, locks: Locks| async move {
        // The outer (user) lock re-enters: both layers act as one owner, through one
        // client.
        let user = locks.try_lock("user:{5}").await.unwrap();
        assert_eq!(user.hold_count(), 2);
        assert_eq!(user.owner(), held.owner());
        held.key().to_string()
    };
    // One client for both layers: re-entry is counted by the client that holds the lock.
    let client = LockClient::new(backend.clone());
    let app = Router::new()
        .route("/docs/{id}", post(handler))
        .route_layer(LockLayer::new(client.clone(), by_doc))
        .layer(LockLayer::new(client, by_user))
        .layer(auth);
    assert_eq!(
        call(&app, "POST", "/docs/3", Some("5")).await,
        (StatusCode::OK, "doc:{3}".into())
    );
    // A missing extension is the server's wiring: a 500 whose details are logged, not
    // sent to the client.
    let (status, body) = call(&app, "POST", "/docs/3", None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!body.contains("UserId"), "{body}");
    assert!(body.contains("misconfigured"), "{body}");
    for _ in 0..100 {
        if backend.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("locks left behind");
}

/// Regression (issue 24, item 7): the layer's `key_prefix("lock:")` was accepted and
/// doubled the separator (`lock::{42}`), as did an extractor's `namespace("lock:")`.
/// Every prefix setting follows one rule — segments joined by `:`, the joining `:`
/// added by the crate — and refuses a `:` at either end by name.
#[test]
fn one_prefix_rule_refuses_a_doubled_separator_by_name() {
    let layer = LockLayer::builder(
        LockClient::new(MemoryBackend::new()),
        HeaderKey::new(HeaderName::from_static("x-user-id")),
    );
    match layer.key_prefix("lock:").build() {
        Err(ConfigError::InvalidSetting {
            name: "key_prefix",
            reason,
        }) => assert!(reason.contains("write \"lock\""), "{reason}"),
        other => panic!("key_prefix(\"lock:\"): {other:?}"),
    }
    for bad in ["order:", ":order", "lock::order"] {
        assert!(matches!(
            HeaderKey::new(HeaderName::from_static("x-user-id")).namespace(bad),
            Err(ConfigError::InvalidSetting {
                name: "namespace",
                ..
            })
        ));
        assert!(matches!(
            PathParamKey::new("id").namespace(bad),
            Err(ConfigError::InvalidSetting {
                name: "namespace",
                ..
            })
        ));
        assert!(matches!(
            LockKey::namespaced(bad, "42"),
            Err(ConfigError::InvalidKey { .. })
        ));
    }
    // The one spelling: the `:` is added once.
    assert_eq!(
        LockKey::namespaced("lock:order", "42").unwrap().as_str(),
        "lock:order:{42}"
    );
}

/// The hold ids of `key`'s holders, in the store.
async fn hold_ids(locks: &Locks, key: &str) -> Vec<String> {
    let state = locks
        .client()
        .get_lock(key)
        .unwrap()
        .inspect()
        .await
        .unwrap();
    state
        .holders
        .iter()
        .map(|h| h.hold_id.as_str().to_owned())
        .collect()
}

#[tokio::test]
async fn the_layers_hold_is_named_by_its_fresh_owner_and_every_later_hold_by_its_own() {
    let backend = MemoryBackend::new();
    let handler = |held: HeldLock, locks: Locks| async move {
        let owner = held.owner().as_str().to_owned();
        // The layer's hold: the owner it made for this request names it in the store.
        assert_eq!(
            hold_ids(&locks, held.key().as_str()).await,
            std::slice::from_ref(&owner)
        );
        // The handler's own holds, as the same owner, are named each by its own.
        let side = locks.lock("side").await.unwrap();
        let first = side.hold_id().as_str().to_owned();
        assert_ne!(first, owner);
        side.unlock().await.unwrap();
        let again = locks.lock("side").await.unwrap();
        assert_ne!(again.hold_id().as_str(), first);
        assert_ne!(again.hold_id().as_str(), owner);
        assert_eq!(again.owner().as_str(), owner);
        "ok"
    };
    let app = Router::new()
        .route("/h", post(handler))
        .layer(LockLayer::new(
            backend.clone(),
            HeaderKey::new(USER).namespace("user").unwrap(),
        ));
    for _ in 0..2 {
        assert_eq!(
            call(&app, "POST", "/h", Some("4")).await,
            (StatusCode::OK, "ok".into())
        );
    }
    assert!(backend.is_empty());
}

#[tokio::test]
async fn nested_layers_share_the_owner_and_the_inner_layer_names_its_hold_anew() {
    let backend = MemoryBackend::new();
    let handler = |held: Option<HeldLock>, locks: Locks| async move {
        let owner = locks.owner().as_str().to_owned();
        let Some(held) = held else {
            return "none".to_owned();
        };
        assert_eq!(held.owner().as_str(), owner);
        // The outer layer made the owner: its hold carries the owner's string.
        assert_eq!(
            hold_ids(&locks, "user:{5}").await,
            std::slice::from_ref(&owner)
        );
        let inner = hold_ids(&locks, "doc:{d}").await;
        assert!(inner.iter().all(|id| *id != owner), "{inner:?} {owner}");
        held.key().to_string()
    };
    let app = Router::new()
        .route("/h", post(handler))
        .layer(LockLayer::new(
            backend.clone(),
            HeaderKey::new(HeaderName::from_static("x-doc"))
                .namespace("doc")
                .unwrap()
                .optional(),
        ))
        .layer(LockLayer::new(
            backend.clone(),
            HeaderKey::new(USER).namespace("user").unwrap(),
        ));
    let request = |doc: Option<&str>| {
        let mut req = Request::builder()
            .method("POST")
            .uri("/h")
            .header(USER, "5");
        if let Some(doc) = doc {
            req = req.header("x-doc", doc);
        }
        let app = app.clone();
        async move {
            let res = app.oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            String::from_utf8(body.to_vec()).unwrap()
        }
    };
    // Both layers lock: the handler sees the inner layer's lock.
    assert_eq!(request(Some("d")).await, "doc:{d}");
    // The inner layer gives this request no key: the outer layer's lock is still seen.
    assert_eq!(request(None).await, "user:{5}");
    assert!(backend.is_empty());
}
