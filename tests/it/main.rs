//! The integration tests, as one crate: one module per area, `common` compiled once and
//! one binary linked, where a test binary per file compiled `common` and linked every
//! dependency again each time.
//!
//! Two test files stay binaries of their own: `tests/redis_processes.rs` (its own `main`,
//! which runs this binary again as a holder process) and `tests/seckill.rs` (it installs
//! the process's global metrics recorder).

mod common;

mod acquire_cancellation;
#[cfg(feature = "redis")]
mod clock_steps;
mod conformance_memory;
#[cfg(feature = "mysql")]
mod conformance_mysql;
#[cfg(feature = "postgres")]
mod conformance_postgres;
#[cfg(feature = "redis")]
mod conformance_redis;
mod conformance_redlock;
#[cfg(feature = "zookeeper")]
mod conformance_zookeeper;
#[cfg(feature = "axum")]
mod extract;
#[cfg(feature = "redis")]
mod fault_costs;
mod growth;
mod history;
#[cfg(feature = "mysql")]
mod history_mysql;
#[cfg(feature = "postgres")]
mod history_postgres;
#[cfg(feature = "redis")]
mod history_redis;
#[cfg(feature = "zookeeper")]
mod history_zookeeper;
mod http;
#[cfg(feature = "axum")]
mod http_contract;
#[cfg(feature = "axum")]
mod idempotency;
#[cfg(feature = "axum")]
mod idempotent_runs;
mod kinds_memory;
#[cfg(feature = "mysql")]
mod kinds_mysql;
#[cfg(feature = "postgres")]
mod kinds_postgres;
#[cfg(feature = "redis")]
mod kinds_redis;
#[cfg(feature = "zookeeper")]
mod kinds_zookeeper;
mod layer;
#[cfg(feature = "mysql")]
mod mariadb_server;
#[cfg(all(feature = "metrics", feature = "axum"))]
mod metrics;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "mysql")]
mod mysql_crashes;
#[cfg(all(feature = "mysql", feature = "postgres", feature = "redis"))]
mod mysql_processes;
mod observer;
#[cfg(feature = "axum")]
mod path_keys;
#[cfg(feature = "postgres")]
mod postgres_batch;
#[cfg(feature = "postgres")]
mod postgres_faults;
#[cfg(all(feature = "postgres", feature = "redis"))]
mod postgres_processes;
#[cfg(feature = "postgres")]
mod postgres_regressions;
mod proxy;
#[cfg(all(feature = "redis", feature = "axum"))]
mod redaction;
#[cfg(feature = "redis")]
mod redis_backend;
#[cfg(feature = "cluster")]
mod redis_cluster;
#[cfg(feature = "cluster")]
mod redis_cluster_failover;
#[cfg(feature = "cluster")]
mod redis_cluster_pubsub;
#[cfg(feature = "sentinel")]
mod redis_failover;
#[cfg(feature = "redis")]
mod redis_faults;
#[cfg(all(feature = "postgres", feature = "redis"))]
mod redis_hammers;
#[cfg(feature = "sentinel")]
mod redis_sentinel_url;
#[cfg(feature = "redis")]
mod redisson_kinds;
mod redlock_memory;
#[cfg(feature = "redis")]
mod redlock_redis;
mod safety_regressions;
#[cfg(feature = "redis")]
mod transit_faults;
mod watchdog;
#[cfg(feature = "zookeeper")]
mod zookeeper_faults;
#[cfg(feature = "zookeeper")]
mod zookeeper_interop;
#[cfg(feature = "zookeeper")]
mod zookeeper_servers;
