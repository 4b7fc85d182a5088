//! A flash sale ("seckill") served through `LockLayer`: one order per user per voucher,
//! however many times the user clicks.
//!
//! ```sh
//! cargo run --example seckill                  # serve on 127.0.0.1:3000, voucher 1 with 100 in stock
//! cargo run --example seckill -- --demo        # 300 users × 5 orders, each sent 3 times: check the invariants
//! cargo run --example seckill -- --demo --no-lock   # the same without the lock: watch it break
//!
//! # Locks and data in Redis, shared by every process that uses it:
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example seckill -- --demo
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example seckill -- --addr 127.0.0.1:3000
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example seckill -- --addr 127.0.0.1:3001
//! # Behind Sentinel (feature `sentinel`): the primary the Sentinels monitor as mymaster.
//! REDIS_URL=redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/mymaster \
//!     cargo run --features sentinel --example seckill -- --demo
//!
//! # Vouchers, orders and locks in one database, shared by every process on it:
//! DATABASE_URL=postgres://root@127.0.0.1:5432/app cargo run --example seckill -- --demo
//! DATABASE_URL=mysql://root@127.0.0.1:3306/test cargo run --example seckill -- --demo
//!
//! # The order locks on ZooKeeper (feature `zookeeper`), the data where it was:
//! ZOOKEEPER_URL=zk://127.0.0.1:2181 cargo run --features zookeeper --example seckill -- --demo
//! ZOOKEEPER_URL=zk://127.0.0.1:2181 REDIS_URL=redis://127.0.0.1:6379 \
//!     cargo run --features zookeeper --example seckill -- --demo
//! ```
//!
//! Each order runs "has this user ordered? → take stock → insert the order". The check
//! and the insert are separate steps, so two concurrent requests of one user can both
//! pass the check and both order. `LockLayer` keyed by `lock:order:{<user id>}`
//! serializes each user's requests; different users never wait for each other.
//!
//! An order may carry an `Idempotency-Key` header (a UUID the client picks per order).
//! `IdempotencyLayer`, scoped by the user, runs the first request with a key and stores
//! its answer; a retry with the same key (a client whose answer got lost) gets that
//! answer again, the same `201` with the same order id, with `Idempotent-Replayed:
//! true`, and the handler does not run — instead of a `409 duplicate_order` for its own
//! order. A retry that arrives while its first is still running waits for its answer
//! (up to `--wait-first-ms`, default 1000), then gets `409 in_flight` with
//! `Retry-After`. A new key is a new order: the user's second gets `409
//! duplicate_order`. The demo sends every order three times with its key, once while
//! the first is in flight and once after its answer, and checks that the handler ran
//! once per key and that every retry was answered from the stored response.
//!
//! Without `REDIS_URL` the locks and the store live in this process. With it, the locks
//! are `RedisBackend` locks and vouchers and orders are in Redis (see
//! `seckill/redis_store.rs`; every key starts with `seckill:`), so several server
//! processes on different `--addr`s serve one sale, and a user's requests exclude each
//! other whichever process they reach. A server seeds voucher 1 with `--stock` only if
//! it is not in Redis yet (`SET NX`): the second process joins the first one's sale
//! instead of restocking it. `--reset` starts the sale afresh, and `--demo` always does.
//! (`--redis-url URL` does the same as `REDIS_URL`.)
//!
//! With `DATABASE_URL=postgres://...` (or `--database-url`), vouchers, stock and orders
//! are PostgreSQL tables (`seckill/pg_store.rs`, created at start), and the locks are
//! `PostgresBackend` locks on the same database — or `RedisBackend` locks when
//! `REDIS_URL` is set too. With `DATABASE_URL=mysql://...` (or `mariadb://`), the same
//! with MySQL or MariaDB tables (`seckill/mysql_store.rs`) and `MySqlBackend` locks.
//! The order write carries the lock's fencing token and the database refuses a stale
//! one (a holder that paused past its lease while a newer one took over): `409
//! stale_token`.
//!
//! With `ZOOKEEPER_URL=zk://host:port[,host:port][/chroot]` (or `--zookeeper-url`;
//! feature `zookeeper`) the users' order locks are `ZooKeeperBackend` locks under
//! `/seckill` (user 42's is the directory `/seckill/lock:order:{42}`, in Curator's
//! `InterProcessMutex` layout), and the data stays where the other settings put it: in
//! this process, in Redis or in the database. ZooKeeper keeps no stored responses, so
//! the idempotency keys — their locks and the answers stored for replay — stay with the
//! data too (in the process, in Redis, or in the database's `tower_lock*` tables; with
//! both `DATABASE_URL` and `REDIS_URL`, in Redis). The order write is fenced with the
//! ZooKeeper lock's token, a zxid. A process that dies holding an order lock loses it
//! when ZooKeeper expires its session (10 s), or when its lease ends, whichever is first.
//!
//! The operator's side runs on a listener of its own, never on the public one
//! (`--admin HOST:PORT`, default a free port on 127.0.0.1, printed at start; see
//! `seckill/admin.rs`): `GET /metrics` in Prometheus format (`MetricsObserver` on the
//! lock client; the exporter is given `tower_lock::metrics::BUCKETS`, so the lock
//! histograms have `_bucket` series to add up across processes), `GET /ready` for a
//! readiness probe (200 while the lock store answers, 503 otherwise), and
//! `GET /admin/users/{id}/lock` or `GET /admin/locks?key=...` with who holds a lock —
//! owner, client name (`--name`, default `seckill-<pid>`), since when, lease left — and
//! how many wait.
//!
//! Logs go to stderr at the level `RUST_LOG` names (`RUST_LOG=debug`; default `info`):
//! with the lock store down, the order layer (`layer="orders"`) logs one WARN, then one
//! every 10 s with the count of requests answered 503 since.
//!
//! Ctrl-C stops taking connections, lets the orders in flight finish, then shuts the
//! lock client down (`LockClient::shutdown`): its locks are released at once, not when
//! their leases end, and its name leaves the store.
//!
//! Other flags: `--stock N` (voucher 1's stock, default 100), `--wait-ms N` (how long an
//! order waits for its user's lock, default 50), `--work-ms N` (simulated work inside an
//! order, default 20), `--lease-ms N` (the locks' watchdog lease: how long a killed
//! process's locks stay held, default 30000), `--users N`, `--per-user N` and
//! `--retries N` (the demo's burst, default 300 users × 5 orders, each sent 1 + 2 times;
//! 1 to 1000 per user, 0 to 9 retries); `--help` lists them all. Bad arguments exit 2.

#[path = "seckill/admin.rs"]
mod admin;
#[path = "seckill/app.rs"]
mod app;
#[path = "seckill/mysql_store.rs"]
mod mysql_store;
#[path = "seckill/pg_store.rs"]
mod pg_store;
#[cfg(feature = "redis")]
#[path = "seckill/redis_store.rs"]
mod redis_store;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use app::{Burst, HandlerRuns, MemoryStore, Settings, Store};
use clap::{CommandFactory, Parser};
use tower_lock::{LockClient, MemoryBackend};

const VOUCHER: u64 = 1;

/// A flash sale served through `LockLayer`: one order per user per voucher, and a
/// retried order (same `Idempotency-Key`) answered with its first answer, replayed.
#[derive(Parser)]
#[command(
    name = "seckill",
    args_override_self = true,
    allow_negative_numbers = true
)]
struct Cli {
    /// Where to serve (a `--demo` serves on a free port instead).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:3000")]
    addr: SocketAddr,
    /// Voucher 1's stock (not negative).
    #[arg(long, value_name = "N", default_value_t = 100)]
    stock: i64,
    /// Start the sale afresh in Redis even if it is running.
    #[arg(long)]
    reset: bool,
    /// How long an order waits for its user's lock, in milliseconds.
    #[arg(long, value_name = "N", default_value_t = millis(Settings::default().wait))]
    wait_ms: u64,
    /// Simulated work inside an order, in milliseconds.
    #[arg(long, value_name = "N", default_value_t = millis(Settings::default().work))]
    work_ms: u64,
    /// How long a retried order (same `Idempotency-Key`) arriving while its first
    /// request is still in flight waits for that answer to replay it, before it is
    /// answered 409 in_flight, in milliseconds.
    #[arg(long, value_name = "N", default_value_t = millis(Settings::default().wait_first))]
    wait_first_ms: u64,
    /// The locks' watchdog lease, in milliseconds: renewed every third of it while a
    /// request runs, and how long a killed process's locks stay held.
    #[arg(long, value_name = "N", default_value_t = millis(tower_lock::DEFAULT_WATCHDOG_LEASE))]
    lease_ms: u64,
    /// Serve orders without the per-user lock, to see the race.
    #[arg(long)]
    no_lock: bool,
    /// Fire `--users` × `--per-user` orders at a fresh sale, each sent 1 + `--retries`
    /// times with its `Idempotency-Key`, and check the invariants, instead of serving.
    #[arg(long)]
    demo: bool,
    /// Users in the demo.
    #[arg(long, value_name = "N", default_value_t = 300)]
    users: u64,
    /// Concurrent orders per user in the demo, each with its own `Idempotency-Key`
    /// (1 to 1000).
    #[arg(long, value_name = "N", default_value_t = 5)]
    per_user: u64,
    /// How many more times the demo sends each order with its key: odd-numbered
    /// retries while the first is in flight, even-numbered ones after its answer (0 to
    /// 9).
    #[arg(long, value_name = "N", default_value_t = Burst::default().retries)]
    retries: u64,
    /// Locks and data in this Redis, shared by every process that uses it (default: in
    /// this process).
    #[arg(long, env = "REDIS_URL", value_name = "URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// Vouchers, stock and orders in this PostgreSQL (`postgres://`) or MySQL/MariaDB
    /// (`mysql://`) database (tables created at start), with the write fenced by the
    /// database; the locks too, unless `--redis-url` is set.
    #[arg(long, env = "DATABASE_URL", value_name = "URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The users' order locks on this ZooKeeper ensemble
    /// (`zk://host:port[,host:port][/chroot]`, feature `zookeeper`), under `/seckill`;
    /// the data, the stored answers and the idempotency keys stay where they are.
    #[arg(
        long,
        env = "ZOOKEEPER_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    zookeeper_url: Option<String>,
    /// Where the admin routes (`/metrics`, `/admin/...`) listen: never on `--addr`.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
    admin: SocketAddr,
    /// The lock client's name, shown to operators next to the locks it holds
    /// (default `seckill-<process id>`).
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

struct Args {
    addr: SocketAddr,
    stock: i64,
    reset: bool,
    demo: bool,
    burst: Burst,
    lease: Duration,
    settings: Settings,
    redis_url: Option<String>,
    database_url: Option<String>,
    zookeeper_url: Option<String>,
    admin: SocketAddr,
    name: String,
}

/// The parsed command line, with the checks clap does not make.
fn parse_args() -> Result<Args, String> {
    let cli = Cli::parse();
    if cli.stock < 0 {
        return Err("--stock must not be negative".into());
    }
    if cli.per_user == 0 || cli.per_user > 1000 {
        return Err("--per-user must be between 1 and 1000".into());
    }
    if cli.retries > 9 {
        return Err("--retries must be between 0 and 9".into());
    }
    let lease = Duration::from_millis(cli.lease_ms);
    if lease < tower_lock::MIN_WATCHDOG_LEASE || lease > tower_lock::MAX_LEASE {
        return Err(format!(
            "--lease-ms must be between {} and {}",
            millis(tower_lock::MIN_WATCHDOG_LEASE),
            millis(tower_lock::MAX_LEASE)
        ));
    }
    Ok(Args {
        addr: cli.addr,
        stock: cli.stock,
        reset: cli.reset,
        demo: cli.demo,
        burst: Burst {
            users: cli.users,
            per_user: cli.per_user,
            retries: cli.retries,
            ..Burst::default()
        },
        lease,
        settings: Settings {
            wait: Duration::from_millis(cli.wait_ms),
            work: Duration::from_millis(cli.work_ms),
            wait_first: Duration::from_millis(cli.wait_first_ms),
            no_lock: cli.no_lock,
        },
        // Empty counts as unset, as it did when this read the variable itself.
        redis_url: cli.redis_url.filter(|url| !url.is_empty()),
        database_url: cli.database_url.filter(|url| !url.is_empty()),
        zookeeper_url: cli.zookeeper_url.filter(|url| !url.is_empty()),
        admin: cli.admin,
        name: cli
            .name
            .unwrap_or_else(|| format!("seckill-{}", std::process::id())),
    })
}

/// The lock client and the store, with voucher 1 in it. Everything else is the same
/// whatever they are: this is the one place to choose them.
async fn backend_and_store(args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    if let Some(url) = &args.database_url {
        return if is_mysql(url) {
            on_mysql(url, args).await
        } else {
            on_postgres(url, args).await
        };
    }
    match &args.redis_url {
        Some(url) => on_redis(url, args).await,
        None => {
            if args.zookeeper_url.is_some() {
                println!(
                    "store: memory (orders, stored answers and idempotency keys in this process)"
                );
            } else {
                println!(
                    "backend: memory (locks and orders in this process; set REDIS_URL to share them)"
                );
            }
            let client = client_on(MemoryBackend::new(), args)?;
            let store: Arc<dyn Store> = Arc::new(MemoryStore::with_voucher(VOUCHER, args.stock));
            Ok((client, store))
        }
    }
}

/// The lock client on `backend`: named for operators, with its metrics recorded and
/// the watchdog lease of `--lease-ms`.
fn client_on(
    backend: impl tower_lock::backend::LockBackend,
    args: &Args,
) -> Result<LockClient, String> {
    LockClient::builder(backend)
        .name(&args.name)
        .watchdog_lease(args.lease)
        .observer(tower_lock::metrics::MetricsObserver::new())
        .build()
        .map_err(|e| match e {
            tower_lock::ConfigError::InvalidSetting {
                name: "watchdog_lease",
                ..
            } => format!("--lease-ms: {e}"),
            e => format!("--name: {e}"),
        })
}

/// Whether `url` is a MySQL or MariaDB URL (else it is taken for PostgreSQL's).
fn is_mysql(url: &str) -> bool {
    ["mysql://", "mariadb://"].iter().any(|scheme| {
        url.get(..scheme.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
    })
}

/// `PgStore` for the data, and `PostgresBackend` on the same pool for the locks (or
/// `RedisBackend` when a Redis URL is given too).
async fn on_postgres(url: &str, args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    use pg_store::PgStore;
    use tower_lock::PostgresBackend;

    // Where, without the password the URL may carry.
    let server = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .map(|o| {
            format!(
                "{}:{}/{}",
                o.get_host(),
                o.get_port(),
                o.get_database().unwrap_or("")
            )
        })
        .map_err(|e| format!("DATABASE_URL is not a PostgreSQL URL: {e}"))?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .acquire_timeout(Duration::from_secs(2))
        // A lock statement is a short round trip; testing the connection first would
        // double it (docs/postgres.md, "The pool").
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| format!("cannot reach PostgreSQL at {server}: {e}"))?;
    let store = PgStore::open(pool.clone()).await.map_err(|e| e.0)?;
    let (reset, seed) = (
        store.reset(VOUCHER, args.stock),
        store.seed(VOUCHER, args.stock),
    );
    open_sale(args, "PostgreSQL", reset, seed).await?;
    let client = match &args.redis_url {
        Some(redis_url) => redis_locks(redis_url, args, &format!("postgresql at {server}")).await?,
        None => {
            let backend = PostgresBackend::builder(pool)
                .build()
                .await
                .map_err(|e| format!("cannot set up the PostgreSQL locks at {server}: {e}"))?;
            println!(
                "store and locks: postgresql at {server} (tables seckill_* and tower_lock*; \
                 order writes fenced by the database)"
            );
            client_on(backend, args)?
        }
    };
    Ok((client, Arc::new(store)))
}

/// `MySqlStore` for the data, and `MySqlBackend` on the same pool for the locks (or
/// `RedisBackend` when a Redis URL is given too).
async fn on_mysql(url: &str, args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    use mysql_store::MySqlStore;
    use tower_lock::MySqlBackend;

    // Where, without the password the URL may carry.
    let server = url
        .parse::<sqlx::mysql::MySqlConnectOptions>()
        .map(|o| {
            format!(
                "{}:{}/{}",
                o.get_host(),
                o.get_port(),
                o.get_database().unwrap_or("")
            )
        })
        .map_err(|e| format!("DATABASE_URL is not a MySQL URL: {e}"))?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(20)
        .acquire_timeout(Duration::from_secs(2))
        // A lock call is a short round trip; pinging the connection first would double
        // it (docs/mysql.md).
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| format!("cannot reach MySQL at {server}: {e}"))?;
    let store = MySqlStore::open(pool.clone()).await.map_err(|e| e.0)?;
    let (reset, seed) = (
        store.reset(VOUCHER, args.stock),
        store.seed(VOUCHER, args.stock),
    );
    open_sale(args, "MySQL", reset, seed).await?;
    let client = match &args.redis_url {
        Some(redis_url) => redis_locks(redis_url, args, &format!("mysql at {server}")).await?,
        None => {
            let backend = MySqlBackend::builder(pool)
                .build()
                .await
                .map_err(|e| format!("cannot set up the MySQL locks at {server}: {e}"))?;
            println!(
                "store and locks: mysql at {server} (tables seckill_* and tower_lock*; \
                 order writes fenced by the database)"
            );
            client_on(backend, args)?
        }
    };
    Ok((client, Arc::new(store)))
}

/// Voucher 1 in a database store, as `--demo`, `--reset` and `--stock` ask: the sale
/// started afresh (`reset`), or seeded (`seed`) unless `database` has it already, in
/// which case this process joins that sale. Only the one chosen is awaited.
async fn open_sale(
    args: &Args,
    database: &str,
    reset: impl std::future::Future<Output = Result<(), app::StoreError>>,
    seed: impl std::future::Future<Output = Result<bool, app::StoreError>>,
) -> Result<(), String> {
    let stock = args.stock;
    if args.demo || args.reset {
        reset.await.map_err(|e| e.0)?;
        println!("voucher {VOUCHER}: sale started afresh with {stock} in stock");
    } else if seed.await.map_err(|e| e.0)? {
        println!("voucher {VOUCHER}: seeded with {stock} in stock");
    } else {
        println!(
            "voucher {VOUCHER}: already in {database}; joining that sale (--stock not applied; \
             --reset starts afresh)"
        );
    }
    Ok(())
}

/// The lock client on `RedisBackend` at `redis_url`, for a store in a database
/// (`store`, as printed).
async fn redis_locks(redis_url: &str, args: &Args, store: &str) -> Result<LockClient, String> {
    let backend = tower_lock::RedisBackend::from_url(redis_url)
        .build()
        .await
        .map_err(|e| format!("cannot reach Redis for the locks: {e}"))?;
    println!("store: {store}; locks: redis");
    client_on(backend, args)
}

/// `RedisBackend` for the locks and `RedisStore` for the data, on the server at `url`.
#[cfg(feature = "redis")]
async fn on_redis(url: &str, args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    use redis_store::{NAMESPACE, RedisStore, Seeded};
    use tower_lock::RedisBackend;

    // Where, without the password the URL may carry; behind Sentinel, the primary they
    // name now, where the store's connection goes (and follows a failover, as the locks
    // do).
    let (server, store_client, sentinels) = redis_server(url).await?;
    let backend = RedisBackend::from_url(url)
        .key_prefix(NAMESPACE)
        .build()
        .await
        // The error names the server already (never with its password).
        .map_err(|e| format!("cannot reach Redis for the locks: {e}"))?;
    let store = RedisStore::with_client(store_client, sentinels)
        .await
        .map_err(|e| format!("cannot reach Redis at {server} for the store: {}", e.0))?;
    println!(
        "backend: redis at {server} (locks and orders shared by every process using it; \
         keys {NAMESPACE}:*, fencing counters redisson_lock_token:{NAMESPACE}:*)"
    );
    if args.demo || args.reset {
        store.reset(VOUCHER, args.stock).await.map_err(|e| e.0)?;
        println!(
            "voucher {VOUCHER}: sale started afresh with {} in stock",
            args.stock
        );
    } else {
        match store.seed(VOUCHER, args.stock).await.map_err(|e| e.0)? {
            Seeded::Fresh => {
                println!("voucher {VOUCHER}: seeded with {} in stock", args.stock)
            }
            Seeded::Existing(view) => println!(
                "voucher {VOUCHER}: already in Redis ({} in stock, {} orders); joining that sale \
                 (--stock not applied; --reset starts afresh)",
                view.stock, view.orders
            ),
        }
    }
    Ok((client_on(backend, args)?, Arc::new(store)))
}

/// Where `url` points (without its password), a client for it, and behind Sentinel
/// what asks them where the primary is: the server of a `redis://` URL, or the primary
/// the Sentinels of a `redis+sentinel://` URL name now.
#[cfg(feature = "redis")]
async fn redis_server(
    url: &str,
) -> Result<(String, redis::Client, Option<redis_store::Sentinels>), String> {
    use redis::IntoConnectionInfo;

    #[cfg(feature = "sentinel")]
    if url
        .get(..17)
        .is_some_and(|s| s.eq_ignore_ascii_case("redis+sentinel://"))
    {
        let parsed = tower_lock::backend::redis::SentinelUrl::parse(url)
            .map_err(|e| format!("REDIS_URL: {e}"))?;
        let mut sentinels = parsed
            .sentinel_client()
            .map_err(|e| format!("REDIS_URL: {e}"))?;
        let client = sentinels
            .async_get_client()
            .await
            .map_err(|e| format!("the Sentinels of REDIS_URL name no primary: {e}"))?;
        let server = format!(
            "{} (primary {} of the Sentinels {})",
            client.get_connection_info().addr(),
            parsed.master(),
            parsed.sentinels().join(",")
        );
        return Ok((server, client, Some(tokio::sync::Mutex::new(sentinels))));
    }
    let server = url
        .into_connection_info()
        .map_err(|e| format!("REDIS_URL is not a Redis URL: {e}"))?
        .addr()
        .to_string();
    let client = redis::Client::open(url).map_err(|e| format!("REDIS_URL: {e}"))?;
    Ok((server, client, None))
}

#[cfg(not(feature = "redis"))]
async fn on_redis(_url: &str, _args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    Err("REDIS_URL is set, but this build has no Redis support (enable the `redis` feature)".into())
}

/// The root of the order locks on ZooKeeper: user 42's is `/seckill/lock:order:{42}`.
#[cfg(feature = "zookeeper")]
const ZOOKEEPER_ROOT: &str = "/seckill";

/// The lock client for the order locks on the ZooKeeper ensemble at `url`
/// (`zk://host:port[,host:port][/chroot]`, or the connect string alone).
#[cfg(feature = "zookeeper")]
async fn zookeeper_locks(url: &str, args: &Args) -> Result<LockClient, String> {
    let hosts = url
        .get(..5)
        .filter(|scheme| scheme.eq_ignore_ascii_case("zk://"))
        .map_or(url, |_| &url[5..]);
    let backend = tower_lock::ZooKeeperBackend::builder(hosts)
        .root(ZOOKEEPER_ROOT)
        .build()
        .await
        .map_err(|e| format!("cannot set up the order locks on ZooKeeper at {hosts}: {e}"))?;
    println!(
        "order locks: zookeeper at {hosts} (under {ZOOKEEPER_ROOT}, Curator's \
         InterProcessMutex layout; session {:#x}); the stored answers and their keys' locks \
         stay with the store",
        backend.session_id()
    );
    client_on(backend, args)
}

#[cfg(not(feature = "zookeeper"))]
async fn zookeeper_locks(_url: &str, _args: &Args) -> Result<LockClient, String> {
    Err(
        "ZOOKEEPER_URL is set, but this build has no ZooKeeper support (enable the `zookeeper` \
         feature)"
            .into(),
    )
}

/// The sale's lock clients: the order locks', and the idempotency keys' (the data
/// store's) when the order locks are elsewhere (ZooKeeper).
struct Clients {
    orders: LockClient,
    replays: Option<LockClient>,
}

impl Clients {
    /// The idempotency keys' client: the data store's.
    fn replays(&self) -> &LockClient {
        self.replays.as_ref().unwrap_or(&self.orders)
    }

    fn all(&self) -> impl Iterator<Item = &LockClient> {
        std::iter::once(&self.orders).chain(&self.replays)
    }

    /// Registers each client's name in its store (a failure is printed, not fatal).
    async fn register_names(&self) {
        for client in self.all() {
            if let Err(error) = client.register_name().await {
                eprintln!("seckill: could not register the client's name in the store: {error}");
            }
        }
    }

    /// Shuts every client down: its locks released at once, its name out of its store.
    async fn shutdown(&self) -> Result<(), String> {
        for client in self.all() {
            client
                .shutdown()
                .await
                .map_err(|e| format!("lock client shutdown: {e}"))?;
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    init_logging();
    let args = match parse_args() {
        Ok(args) => args,
        // Exits 2, as clap does for the errors it finds itself.
        Err(message) => Cli::command()
            .error(clap::error::ErrorKind::ValueValidation, message)
            .exit(),
    };
    match run(args).await {
        Ok(code) => code,
        Err(message) => {
            eprintln!("seckill: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr at the level `RUST_LOG` names (`error`, `warn`, `info`, `debug` or
/// `trace`; default `info`): at `info`, a lock store outage is one WARN line per
/// interval from the order layer, and a wiring mistake one ERROR line.
fn init_logging() {
    let level = match std::env::var("RUST_LOG") {
        Err(_) => tracing::Level::INFO,
        Ok(level) => level.parse().unwrap_or_else(|_| {
            eprintln!("seckill: RUST_LOG={level:?} is not a level (error, warn, info, debug, trace); logging at info");
            tracing::Level::INFO
        }),
    };
    let logger = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .try_init();
    if let Err(error) = logger {
        eprintln!("seckill: no log: {error}");
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    // Before the client is made: its observer describes the metrics to this recorder.
    let prometheus = admin::install_prometheus()?;
    let (client, store) = backend_and_store(&args).await?;
    let clients = match &args.zookeeper_url {
        Some(url) => Clients {
            orders: zookeeper_locks(url, &args).await?,
            replays: Some(client),
        },
        None => Clients {
            orders: client,
            replays: None,
        },
    };
    clients.register_names().await;
    let client = clients.orders.clone();
    let admin_listener = tokio::net::TcpListener::bind(args.admin)
        .await
        .map_err(|e| format!("cannot listen on {} (--admin): {e}", args.admin))?;
    let admin_addr = admin_listener.local_addr().map_err(|e| e.to_string())?;
    let admin_app = match &clients.replays {
        Some(replays) => admin::admin_on(client.clone(), replays.clone(), prometheus),
        None => admin::admin(client.clone(), prometheus),
    };
    let admin_server = tokio::spawn(async move { axum::serve(admin_listener, admin_app).await });
    println!(
        "admin: http://{admin_addr}/metrics, http://{admin_addr}/ready and \
         http://{admin_addr}/admin/users/42/lock (client {} = {})",
        args.name,
        client.id()
    );
    let runs = HandlerRuns::default();
    let app = app::app_on(
        client.clone(),
        clients.replays().clone(),
        store.clone(),
        args.settings,
        runs.clone(),
    )
    .map_err(|e| e.to_string())?;
    let addr = if args.demo {
        SocketAddr::from(([127, 0, 0, 1], 0))
    } else {
        args.addr
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;

    if !args.demo {
        let stock = match store.voucher(VOUCHER).await.map_err(|e| e.0)? {
            Some(voucher) => voucher.stock,
            None => return Err(format!("voucher {VOUCHER} is missing from the store")),
        };
        println!("seckill: voucher {VOUCHER} with {stock} in stock, on http://{addr}");
        println!("try:");
        println!(
            "  curl -i -X POST -H 'x-user-id: 42' http://{addr}/vouchers/{VOUCHER}/orders   # 201, then 409"
        );
        println!(
            "  curl -i -X POST -H 'x-user-id: 7' -H 'Idempotency-Key: 7-a' http://{addr}/vouchers/{VOUCHER}/orders   # 201; again: the same 201, replayed"
        );
        println!(
            "  curl -i http://{addr}/vouchers/{VOUCHER}                                   # stock and orders"
        );
        println!(
            "  curl -i -X POST http://{addr}/vouchers/{VOUCHER}/orders                    # 400: no x-user-id"
        );
        println!("  curl -i http://{addr}/vouchers/2                                       # 404");
        println!("stop with Ctrl-C (or SIGTERM)");
        axum::serve(listener, app)
            .with_graceful_shutdown(stop_requested())
            .await
            .map_err(|e| format!("server failed: {e}"))?;
        admin_server.abort();
        // The orders in flight are done: free this process's locks now rather than
        // when their leases end, and take its name out of the store.
        clients.shutdown().await?;
        println!("seckill: stopped; lock client {} shut down", client.id());
        return Ok(ExitCode::SUCCESS);
    }

    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let shape = args.burst;
    println!(
        "seckill demo: {} users × {} concurrent orders, each sent {} times with its Idempotency-Key \
         ({} while the first is in flight, {} after its answer), against {} in stock on http://{addr} \
         ({}; lock wait {:?}, handler work {:?}, a retry waits up to {:?} for its first)",
        shape.users,
        shape.per_user,
        1 + shape.retries,
        shape.retries.div_ceil(2),
        shape.retries / 2,
        args.stock,
        if args.settings.no_lock {
            "NO LOCK"
        } else {
            "LockLayer on lock:order:{user}"
        },
        args.settings.wait,
        args.settings.work,
        args.settings.wait_first,
    );
    let started = tokio::time::Instant::now();
    let tally = app::burst(&[addr], VOUCHER, shape).await?;
    let elapsed = started.elapsed();
    server.abort();
    admin_server.abort();
    if let Err(error) = clients.shutdown().await {
        eprintln!("seckill: {error}");
    }
    println!("\n{}", app::table(&tally));
    println!("({} requests in {:.2?})\n", tally.requests, elapsed);
    if let Some(what) = &tally.first_other {
        println!("first unexpected answer: {what}\n");
    }
    let verdict = app::verdict(store.as_ref(), VOUCHER, args.stock, &tally, runs.count())
        .await
        .map_err(|e| e.0)?;
    for (check, ok) in &verdict.checks {
        println!("{} {check}", if *ok { "ok  " } else { "FAIL" });
    }
    if verdict.held() {
        println!("\nall invariants held");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("\ninvariants BROKEN");
        Ok(ExitCode::FAILURE)
    }
}

/// Ctrl-C, or SIGTERM as Kubernetes, systemd and `docker stop` send: the server then
/// stops taking connections, finishes the requests in flight, and the lock client is
/// shut down.
async fn stop_requested() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                terminate.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
