//! Shared test support: the redis-server, PostgreSQL, MariaDB and ZooKeeper harnesses
//! (with Curator clients as child processes), the lock-kind suite and helpers. (The
//! backend conformance suite is `tower_lock::testing`, behind the `testing` feature, as
//! a backend outside the crate reaches it.)
//!
//! Compiled once into the `it` test crate (`tests/it/main.rs`), and into the two test
//! binaries of their own (`tests/seckill.rs`, `tests/redis_processes.rs`); each uses part
//! of it.
#![allow(dead_code, unreachable_pub)]

pub mod clock;
#[cfg(feature = "zookeeper")]
pub mod curator;
pub mod history;
pub mod http;
pub mod kinds;
pub mod log;
#[cfg(feature = "mysql")]
pub mod mariadb_server;
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod nemesis;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod proxy;
pub mod redis_server;
pub mod seckill;
pub mod sentinel;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Call before `tracing::subscriber::set_default` in a test that captures a log. Whether
/// a callsite is enabled is decided once, for every thread, and while a single
/// subscriber is registered tracing-core decides with the subscriber of the thread that
/// hits the callsite first: another test of this binary hitting it first, with no
/// subscriber, made the line silent for the capture (`.ci/run` saw no WARN for five
/// 503s, twice). With a second subscriber registered for the binary's life it decides
/// over every registered subscriber, the capture's included.
pub fn log_capture_sees_every_callsite() {
    static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
}

/// Polls `cond` every few milliseconds until it holds or `within` has passed; panics
/// with `what` on timeout. The way to wait for an outcome without sleeping and hoping.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Spawns a waiter for `lock`: `try_lock_for(wait, Lease::Watchdog)`, yielding the
/// moment it acquired and its guard, so a test can bound the wake-up latency.
pub fn spawn_acquire(
    lock: tower_lock::Lock,
    wait: Duration,
) -> tokio::task::JoinHandle<tower_lock::Result<(Instant, tower_lock::LockGuard)>> {
    tokio::spawn(async move {
        let guard = lock.try_lock_for(wait, tower_lock::Lease::Watchdog).await?;
        Ok((Instant::now(), guard))
    })
}

/// A backend whose store is unreachable: every call fails with a backend error. For
/// fail-open/fail-closed policies and error paths.
#[derive(Clone, Copy, Debug, Default)]
pub struct DownBackend;

fn down() -> tower_lock::Error {
    tower_lock::StoreError::msg(
        tower_lock::StoreErrorKind::Unavailable,
        "connection refused (test backend is down)",
    )
    .into()
}

impl tower_lock::backend::LockBackend for DownBackend {
    fn profile(&self) -> &tower_lock::backend::StoreProfile {
        static PROFILE: tower_lock::backend::StoreProfile =
            tower_lock::backend::StoreProfile::new("down");
        &PROFILE
    }
    fn acquire<'a>(
        &'a self,
        _: &'a tower_lock::backend::LockRequest,
    ) -> tower_lock::backend::BoxFuture<'a, tower_lock::Result<tower_lock::backend::Acquire>> {
        Box::pin(async { Err(down()) })
    }
    fn renew<'a>(
        &'a self,
        _: &'a tower_lock::backend::LockRequest,
    ) -> tower_lock::backend::BoxFuture<'a, tower_lock::Result<bool>> {
        Box::pin(async { Err(down()) })
    }
    fn release<'a>(
        &'a self,
        _: &'a tower_lock::backend::LockRequest,
    ) -> tower_lock::backend::BoxFuture<'a, tower_lock::Result<tower_lock::backend::Release>> {
        Box::pin(async { Err(down()) })
    }
    fn abandon<'a>(
        &'a self,
        _: &'a tower_lock::backend::LockRequest,
    ) -> tower_lock::backend::BoxFuture<'a, tower_lock::Result<()>> {
        Box::pin(async { Err(down()) })
    }
    fn subscribe<'a>(
        &'a self,
        _: &'a tower_lock::backend::LockRequest,
    ) -> tower_lock::backend::BoxFuture<
        'a,
        tower_lock::Result<Box<dyn tower_lock::backend::Subscription>>,
    > {
        Box::pin(async { Err(down()) })
    }
    fn cancel_wait<'a>(
        &'a self,
        _: &'a tower_lock::backend::LockRequest,
    ) -> tower_lock::backend::BoxFuture<'a, tower_lock::Result<()>> {
        Box::pin(async { Err(down()) })
    }
    fn admin(&self) -> Option<&dyn tower_lock::backend::StoreAdmin> {
        Some(self)
    }
}

impl tower_lock::backend::StoreAdmin for DownBackend {
    fn force_release<'a>(
        &'a self,
        _: &'a tower_lock::LockKey,
        _: tower_lock::LockMode,
    ) -> tower_lock::backend::BoxFuture<'a, tower_lock::Result<bool>> {
        Box::pin(async { Err(down()) })
    }
    fn inspect<'a>(
        &'a self,
        _: &'a tower_lock::LockKey,
        _: tower_lock::LockMode,
    ) -> tower_lock::backend::BoxFuture<'a, tower_lock::Result<tower_lock::LockState>> {
        Box::pin(async { Err(down()) })
    }
}

/// The path of an example binary of this package, built (once per run of this binary)
/// with this test's features, so it is never a stale build and shares the library
/// already compiled for the tests.
pub fn example_binary(name: &str) -> std::path::PathBuf {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let exe = std::env::current_exe().expect("this test binary");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join("examples").join(name);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|b| b == name) {
        let features = [
            ("redis", cfg!(feature = "redis")),
            ("cluster", cfg!(feature = "cluster")),
            ("postgres", cfg!(feature = "postgres")),
            ("mysql", cfg!(feature = "mysql")),
            ("zookeeper", cfg!(feature = "zookeeper")),
            ("tls", cfg!(feature = "tls")),
            ("axum", cfg!(feature = "axum")),
            ("metrics", cfg!(feature = "metrics")),
            ("testing", cfg!(feature = "testing")),
        ];
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = std::process::Command::new(cargo);
        build
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--quiet", "--example", name]);
        // Cargo set these for this test; passed on, they change how dependencies' build
        // scripts are fingerprinted and rebuild them.
        for (var, _) in std::env::vars() {
            let per_package = [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_CRATE_",
                "CARGO_BIN_",
            ]
            .iter()
            .any(|p| var.starts_with(p));
            if per_package || var == "CARGO_PRIMARY_PACKAGE" || var == "CARGO_TARGET_TMPDIR" {
                build.env_remove(var);
            }
        }
        if features.iter().all(|&(_, on)| on) {
            // Exactly as `cargo test --all-features` resolved them (an explicit list
            // resolves dependencies' features differently and rebuilds them).
            build.arg("--all-features");
        } else {
            let on: Vec<&str> = features
                .iter()
                .filter_map(|&(feature, on)| on.then_some(feature))
                .collect();
            build
                .arg("--no-default-features")
                .args(["--features", &on.join(",")]);
        }
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "building example {name}");
        built.push(name.to_owned());
    }
    assert!(path.exists(), "no example binary at {}", path.display());
    path
}

/// A router served over real TCP on a free loopback port, until dropped.
///
/// The router is made into a service once (`into_make_service`), as axum recommends: with
/// `axum::serve(listener, router)` axum turns handler routes into services (and runs the
/// route layers' `layer`) once per connection, so a `ConcurrencyLimitLayer` would be a
/// limit per connection, not per server.
#[cfg(feature = "axum")]
pub struct Server {
    pub addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

#[cfg(feature = "axum")]
impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `app` (see [`Server`]).
#[cfg(feature = "axum")]
pub async fn serve(app: axum::Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app.into_make_service()).await;
    });
    Server { addr, task }
}

/// A named client (`replica-1`, registered) holding a plain, a fair and a read lock on
/// `backend`, with a task of its own queued behind the fair one: what a shutdown must
/// leave nothing of. The guards (kept alive by the caller) and the waiter.
pub async fn holding_every_kind(
    backend: impl tower_lock::backend::LockBackend,
) -> (
    tower_lock::LockClient,
    Vec<tower_lock::LockGuard>,
    tokio::task::JoinHandle<tower_lock::Result<()>>,
) {
    let client = tower_lock::LockClient::builder(backend)
        .name("replica-1")
        .build()
        .unwrap();
    client.register_name().await.unwrap();
    let guards = vec![
        client.get_lock("order:{1}").unwrap().lock().await.unwrap(),
        client
            .get_fair_lock("fair:{1}")
            .unwrap()
            .lock()
            .await
            .unwrap(),
        client
            .get_read_write_lock("rw:{1}")
            .unwrap()
            .read_lock()
            .lock()
            .await
            .unwrap(),
    ];
    let queued = client.get_fair_lock("fair:{1}").unwrap();
    let waiter = tokio::spawn(async move { queued.lock().await.map(drop) });
    (client, guards, waiter)
}
