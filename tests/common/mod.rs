//! Shared test support: the backend conformance suite and helpers.
//!
//! Each integration test binary compiles this module and uses part of it.
#![allow(dead_code, unreachable_pub)]

pub mod conformance;
pub mod kinds;

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

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
