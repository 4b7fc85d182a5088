//! The operator's side of the sale, on its own listener (`--admin`), never on the public
//! one: `GET /metrics` in Prometheus text format, `GET /ready` for a readiness probe
//! (200 while the lock store answers a ping, 503 otherwise), and
//! `GET /admin/locks?key=...` (or `GET /admin/users/{id}/lock`) with who holds a lock,
//! since when, and who waits.
//!
//! With the order locks on ZooKeeper, the idempotency keys and their stored answers are
//! in another store ([`admin_on`]): `/ready` pings both, and a lock is looked up in the
//! store that keeps it.
#![allow(dead_code)] // each includer uses a different part

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;
use tower_lock::{LockClient, LockKey, LockMode, LockState};

use crate::app::json_error;

#[derive(Clone)]
struct Admin {
    /// The order locks' client.
    client: LockClient,
    /// The idempotency keys' client, when it is another store's.
    replays: Option<LockClient>,
    prometheus: PrometheusHandle,
}

impl Admin {
    /// The client of the store that keeps `key`: the order locks' for the order lock
    /// namespace, else the idempotency keys'.
    fn client_of(&self, key: &LockKey) -> &LockClient {
        match &self.replays {
            Some(replays) if key.namespace() != "lock:order" => replays,
            _ => &self.client,
        }
    }
}

/// Installs the process's Prometheus recorder, with `tower_lock`'s histogram buckets, so
/// that `/metrics` has `_bucket` series Prometheus can add up across replicas (without
/// them the exporter renders summaries). Call it before the client is made: its
/// observer describes the metrics to the recorder installed at that moment.
pub fn install_prometheus() -> Result<PrometheusHandle, String> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Prefix("tower_lock_".into()),
            tower_lock::metrics::BUCKETS,
        )
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))
}

/// The admin routes over `client` (whose locks are inspected) and `prometheus` (what
/// `/metrics` renders).
pub fn admin(client: LockClient, prometheus: PrometheusHandle) -> Router {
    routes(Admin {
        client,
        replays: None,
        prometheus,
    })
}

/// The admin routes where the order locks (`order_locks`) and the idempotency keys
/// (`replays`) are in two stores, as `app::app_on` serves them.
pub fn admin_on(
    order_locks: LockClient,
    replays: LockClient,
    prometheus: PrometheusHandle,
) -> Router {
    routes(Admin {
        client: order_locks,
        replays: Some(replays),
        prometheus,
    })
}

fn routes(admin: Admin) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/ready", get(ready))
        .route("/admin/locks", get(lock_by_key))
        .route("/admin/users/{id}/lock", get(lock_of_user))
        .with_state(admin)
}

async fn metrics(State(admin): State<Admin>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        admin.prometheus.render(),
    )
        .into_response()
}

/// `GET /ready`: 200 while the lock store answers a ping ([`LockClient::ping`]) — both
/// stores, when the idempotency keys are in another — else 503 with why (a store is
/// down, or a client was shut down). Without them every order would be refused, so a
/// load balancer should stop sending them.
async fn ready(State(admin): State<Admin>) -> Response {
    let pinged = match &admin.replays {
        Some(replays) => match admin.client.ping().await {
            Ok(()) => replays.ping().await,
            Err(error) => Err(error),
        },
        None => admin.client.ping().await,
    };
    match pinged {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(error) => json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "lock_store_unavailable",
            &error.to_string(),
        ),
    }
}

#[derive(Deserialize)]
struct LockQuery {
    key: String,
    /// `exclusive` (default), `fair`, `read`, `write`: which waiters to count.
    kind: Option<String>,
}

async fn lock_by_key(State(admin): State<Admin>, Query(q): Query<LockQuery>) -> Response {
    let mode = match q.kind.as_deref().unwrap_or("exclusive") {
        "exclusive" => LockMode::Exclusive,
        "fair" => LockMode::Fair,
        "read" => LockMode::Read,
        "write" => LockMode::Write,
        other => {
            return json_error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                &format!("unknown kind {other:?}: exclusive, fair, read or write"),
            );
        }
    };
    match LockKey::new(&q.key) {
        Ok(key) => inspect(admin.client_of(&key), key, mode).await,
        Err(error) => json_error(StatusCode::BAD_REQUEST, "bad_request", &error.to_string()),
    }
}

async fn lock_of_user(State(admin): State<Admin>, Path(user): Path<u64>) -> Response {
    match LockKey::namespaced("lock:order", &user.to_string()) {
        Ok(key) => inspect(&admin.client, key, LockMode::Exclusive).await,
        Err(error) => json_error(StatusCode::BAD_REQUEST, "bad_request", &error.to_string()),
    }
}

async fn inspect(client: &LockClient, key: LockKey, mode: LockMode) -> Response {
    let lock = match client.lock_in_mode(key.clone(), mode) {
        Ok(lock) => lock,
        Err(error) => {
            return json_error(StatusCode::BAD_REQUEST, "bad_request", &error.to_string());
        }
    };
    match lock.inspect().await {
        Ok(state) => axum::Json(describe(&key, &state)).into_response(),
        Err(error) => json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "lock_store_unavailable",
            &error.to_string(),
        ),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The inspection as JSON: what an operator reads at 3 a.m.
pub fn describe(key: &LockKey, state: &LockState) -> serde_json::Value {
    let holders: Vec<serde_json::Value> = state
        .holders
        .iter()
        .map(|h| {
            serde_json::json!({
                "hold_id": h.hold_id.as_str(),
                "client_id": h.client_id(),
                "client": h.client,
                "mode": h.mode.to_string(),
                "holds": h.holds,
                "guards": h.guards,
                "lease_left_ms": h.ttl.map(millis),
                "since_unix_ms": h.since.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(millis),
                "held_for_ms": h.since.and_then(|t| SystemTime::now().duration_since(t).ok()).map(millis),
                "token": h.token.map(|t| t.get()),
            })
        })
        .collect();
    serde_json::json!({
        "key": key.as_str(),
        "locked": state.is_locked(),
        "fencing_token": state.fencing_token.map(|t| t.get()),
        "waiters": { "count": state.waiters.count, "counted_by": state.waiters.scope.to_string() },
        "holders": holders,
    })
}
