//! `seckill` server processes of their own (the example binary) on one store, Redis,
//! PostgreSQL or MySQL: retries of one order alternating between two processes run the
//! handler once and get its answer replayed on either; an order whose handler is
//! SIGKILLed mid-request is `409 in_flight` on another process while the dead one's lock
//! lease runs, runs there once it has ended, and is replayed after that; and on a
//! database, the demo burst spread over two processes sells at most one order per user
//! and never more than the stock.
//!
//! Each test starts its own redis-server or creates its own database (dropped
//! afterwards), and kills every process it starts. They run one at a time: one bounds a
//! timing.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::Answer;
use crate::app::Store;
use crate::common::seckill::Seckill;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The store the processes share.
enum Shared {
    #[cfg(feature = "redis")]
    Redis(crate::common::redis_server::RedisServer),
    #[cfg(feature = "postgres")]
    Postgres(crate::common::postgres::PgDatabase),
    #[cfg(feature = "mysql")]
    MySql(crate::common::mysql::MyDatabase),
}

impl Shared {
    /// How the example is told where the store is.
    fn env(&self) -> (&'static str, String) {
        match self {
            #[cfg(feature = "redis")]
            Shared::Redis(server) => ("REDIS_URL", server.url()),
            #[cfg(feature = "postgres")]
            Shared::Postgres(db) => ("DATABASE_URL", db.url.clone()),
            #[cfg(feature = "mysql")]
            Shared::MySql(db) => ("DATABASE_URL", db.url().to_owned()),
        }
    }

    /// A `seckill` process on this store, with `args`.
    async fn start(&self, args: &[&str]) -> Seckill {
        let (name, value) = self.env();
        Seckill::start(&[(name, value.as_str())], args).await
    }

    /// The orders of voucher 1, read from the store itself.
    async fn orders(&self) -> Vec<crate::app::Order> {
        match self {
            #[cfg(feature = "redis")]
            Shared::Redis(server) => {
                let store = crate::redis_store::RedisStore::connect(&server.url()).await;
                store.unwrap().orders(1).await.unwrap()
            }
            #[cfg(feature = "postgres")]
            Shared::Postgres(db) => {
                let pool = db.pool(1).await;
                let store = crate::pg_store::PgStore::open(pool.clone()).await.unwrap();
                let orders = store.orders(1).await.unwrap();
                pool.close().await;
                orders
            }
            #[cfg(feature = "mysql")]
            Shared::MySql(db) => {
                let pool = db.pool(1).await;
                let store = crate::mysql_store::MySqlStore::open(pool.clone());
                let orders = store.await.unwrap().orders(1).await.unwrap();
                pool.close().await;
                orders
            }
        }
    }

    /// The lease left to the one idempotency lock held, by the store's clock.
    async fn idempotency_lease_left(&self) -> Duration {
        let ms: i64 = match self {
            #[cfg(feature = "redis")]
            Shared::Redis(server) => {
                let mut keys = server.keys("seckill:idempotency:*").await;
                keys.retain(|k| !k.contains(":quota"));
                assert_eq!(keys.len(), 1, "one idempotency lock held: {keys:?}");
                redis::cmd("PTTL")
                    .arg(&keys[0])
                    .query_async(&mut server.conn().await)
                    .await
                    .unwrap()
            }
            #[cfg(feature = "postgres")]
            Shared::Postgres(db) => {
                let pool = db.pool(1).await;
                let ms = sqlx::query_scalar(
                    "SELECT (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint \
                       FROM tower_lock_names \
                      WHERE name LIKE 'idempotency:%' AND owner IS NOT NULL",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                pool.close().await;
                ms
            }
            #[cfg(feature = "mysql")]
            Shared::MySql(db) => {
                let pool = db.pool(1).await;
                let ms = sqlx::query_scalar(
                    "SELECT CAST((expires_us - TIMESTAMPDIFF(MICROSECOND, \
                                  '1970-01-01 00:00:00', UTC_TIMESTAMP(6))) DIV 1000 AS SIGNED) \
                       FROM tower_lock \
                      WHERE name LIKE 'idempotency:%' AND name NOT LIKE '%:quota%'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                pool.close().await;
                ms
            }
        };
        Duration::from_millis(u64::try_from(ms).expect("a lease left"))
    }
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// `POST /vouchers/1/orders` to `addr` as `user` with `key` as its `Idempotency-Key`.
async fn post(client: &HttpClient, addr: SocketAddr, user: u64, key: &str) -> Answer {
    let req = Request::post(format!("http://{addr}/vouchers/1/orders"))
        .header("x-user-id", user)
        .header("idempotency-key", key)
        .body(Empty::new())
        .unwrap();
    let (head, body) = client.request(req).await.unwrap().into_parts();
    let header = |name: &str| head.headers.get(name).map(|v| v.to_str().unwrap());
    Answer {
        status: head.status,
        replayed: header("idempotent-replayed") == Some("true"),
        retry_after: header("retry-after").map(str::to_owned),
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// Replays of the idempotency layer, as `/metrics` of `process` counts them.
async fn replays(process: &Seckill) -> u64 {
    let outcome = "outcome=\"replayed\"";
    let layer = "layer=\"order-replays\"";
    process
        .metric("tower_lock_idempotency_outcomes_total", &[layer, outcome])
        .await
}

/// Two processes, one store: an order sent to both at once, then retried on each in
/// turn. The handler runs once (the two processes' `/metrics` say so); every other
/// send, on either process, gets its `201` with the same order id, replayed. A new key
/// of the same user is a new order: `409 duplicate_order`, replayed on the other process.
async fn retries_alternating_between_two_processes_run_the_order_once(shared: Shared) {
    let _serial = ONE_AT_A_TIME.lock().await;
    // One after the other: the second joins the sale the first seeded. A racing retry
    // waits up to 10 s for its first (not 1 s), so that a loaded machine cannot make it
    // `409 in_flight`.
    let args = |name| ["--stock", "5", "--name", name, "--wait-first-ms", "10000"];
    let a = shared.start(&args("seckill-a")).await;
    let b = shared.start(&args("seckill-b")).await;
    let client = http_client();
    let (first, racer) = tokio::join!(
        post(&client, a.addr, 42, "order-1"),
        post(&client, b.addr, 42, "order-1"),
    );
    let mut answers = vec![first, racer];
    for i in 0..6 {
        let to = if i % 2 == 0 { a.addr } else { b.addr };
        answers.push(post(&client, to, 42, "order-1").await);
    }
    let original: Vec<&Answer> = answers.iter().filter(|a| !a.replayed).collect();
    assert_eq!(
        original.len(),
        1,
        "one answer from the handler: {answers:?}"
    );
    let order = original[0];
    assert_eq!(order.status, StatusCode::CREATED, "{order:?}");
    for answer in &answers {
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        assert_eq!(answer.body, order.body, "the same order id, byte for byte");
    }
    assert_eq!(a.handler_runs().await + b.handler_runs().await, 1);
    let (replays_a, replays_b) = (replays(&a).await, replays(&b).await);
    assert_eq!(replays_a + replays_b, 7);
    assert!(
        replays_a >= 3 && replays_b >= 3,
        "{replays_a} + {replays_b}"
    );

    let second = post(&client, b.addr, 42, "order-2").await;
    assert_eq!(
        second.error().as_deref(),
        Some("duplicate_order"),
        "{second:?}"
    );
    let again = post(&client, a.addr, 42, "order-2").await;
    assert_eq!((again.status, again.replayed), (StatusCode::CONFLICT, true));
    assert_eq!(again.body, second.body);
    assert_eq!(a.handler_runs().await + b.handler_runs().await, 2);

    let orders = shared.orders().await;
    assert_eq!(orders.len(), 1);
    let json: serde_json::Value = serde_json::from_slice(&order.body).unwrap();
    assert_eq!(serde_json::to_value(&orders[0]).unwrap(), json);
}

/// A process whose handler is stuck in an order (`--work-ms` of ten minutes) is
/// SIGKILLed, holding the order's idempotency lock (a 2 s watchdog lease). Its retry on
/// another process is `409 in_flight` with `Retry-After` while that lease runs (after
/// waiting 200 ms for the first, `--wait-first-ms`), never answered before it ends, and
/// runs the handler there once it has; the retries after that are replayed. One order.
async fn an_order_whose_process_is_killed_runs_again_once_its_lease_ends(shared: Shared) {
    const LEASE: Duration = Duration::from_millis(2000);
    let _serial = ONE_AT_A_TIME.lock().await;
    let lease = LEASE.as_millis().to_string();
    let mut stuck = shared
        .start(&["--lease-ms", &lease, "--work-ms", "600000"])
        .await;
    let other = shared
        .start(&["--lease-ms", &lease, "--wait-first-ms", "200"])
        .await;
    let client = http_client();
    let lost = tokio::spawn({
        let (client, addr) = (client.clone(), stuck.addr);
        async move {
            let req = Request::post(format!("http://{addr}/vouchers/1/orders"))
                .header("x-user-id", 7)
                .header("idempotency-key", "order-7")
                .body(Empty::new())
                .unwrap();
            client.request(req).await
        }
    });
    crate::common::wait_until(
        Duration::from_secs(10),
        "the stuck handler runs",
        || async { stuck.handler_runs().await == 1 },
    )
    .await;
    let left = shared.idempotency_lease_left().await;
    let killed_at = Instant::now();
    stuck.kill();
    assert!(lost.await.unwrap().is_err(), "the killed process answered");

    // Sent again at once, and every 50 ms (a test need not honour `Retry-After`), until
    // answered: `409 in_flight` while the lease runs (or `429 busy`, as the user's lock
    // of the killed request ends a moment after its key's).
    let mut in_flight = 0;
    let (answered_after, answer) = loop {
        let answer = post(&client, other.addr, 7, "order-7").await;
        let after = killed_at.elapsed();
        match answer.status {
            StatusCode::CONFLICT if answer.error().as_deref() == Some("in_flight") => {
                assert_eq!(answer.retry_after.as_deref(), Some("1"), "{answer:?}");
                in_flight += 1;
            }
            StatusCode::TOO_MANY_REQUESTS => {}
            _ => break (after, answer),
        }
        assert!(
            after < left + Duration::from_secs(5),
            "no answer {after:?} after the kill"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "killed with {left:?} of the lease left; {in_flight} retries in flight, answered \
         {answered_after:?} after the kill"
    );
    assert!(in_flight >= 1, "no retry found the killed order in flight");
    assert_eq!(
        (answer.status, answer.replayed),
        (StatusCode::CREATED, false)
    );
    assert!(
        answered_after + Duration::from_millis(50) >= left,
        "answered {answered_after:?} after the kill, before the lease ({left:?} left) ended"
    );
    for _ in 0..3 {
        let again = post(&client, other.addr, 7, "order-7").await;
        assert_eq!((again.status, again.replayed), (StatusCode::CREATED, true));
        assert_eq!(again.body, answer.body);
    }
    assert_eq!(other.handler_runs().await, 1);
    let orders = shared.orders().await;
    assert_eq!(orders.len(), 1, "{orders:?}");
    assert_eq!(orders[0].user_id, 7);
}

/// Two processes on one database, the demo burst spread over both (each order's sends
/// alternate between them): at most one order per user, stock + orders = the initial
/// stock and never below zero, each order run once by either process's handler and
/// replayed to its retries on both. The processes' own lock clients, pools and
/// listeners: nothing is shared but the database.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn two_processes_on_one_database_sell_once_per_user_and_never_oversell(shared: Shared) {
    const STOCK: i64 = 40;
    let _serial = ONE_AT_A_TIME.lock().await;
    // A racing retry waits up to 10 s for its first, as above: a loaded machine must
    // not turn it into `409 in_flight` sent again (the tally would still hold, slower).
    let args = |name| ["--stock", "40", "--name", name, "--wait-first-ms", "10000"];
    let a = shared.start(&args("seckill-a")).await;
    let b = shared.start(&args("seckill-b")).await;
    let shape = crate::app::Burst {
        users: 100,
        per_user: 2,
        retries: 2,
        in_flight: 250,
    };
    let started = Instant::now();
    let tally = crate::app::burst(&[a.addr, b.addr], 1, shape)
        .await
        .unwrap();
    let took = started.elapsed();
    let (runs_a, runs_b) = (a.handler_runs().await, b.handler_runs().await);
    let orders = shared.orders().await;
    println!(
        "{}({} requests in {took:.2?}; handler runs {runs_a} + {runs_b}; {} orders for {} \
         users)",
        crate::app::table(&tally),
        tally.requests,
        orders.len(),
        shape.users
    );
    let mut buyers: Vec<u64> = orders.iter().map(|o| o.user_id).collect();
    buyers.sort_unstable();
    buyers.dedup();
    assert_eq!(
        buyers.len(),
        orders.len(),
        "a user ordered twice: {orders:?}"
    );
    assert_eq!(
        (orders.len() as u64, tally.stock_left, tally.orders),
        (STOCK as u64, 0, STOCK as u64),
        "more users than units: every unit sells once, never more"
    );
    assert_eq!(tally.created, STOCK as u64, "{tally:?}");
    assert_eq!(tally.other, 0, "{tally:?}");
    let keys = shape.users * shape.per_user;
    assert_eq!(
        (tally.keys, runs_a + runs_b),
        (keys, keys),
        "one run per key"
    );
    assert!(runs_a > 0 && runs_b > 0, "both processes ran orders");
    assert_eq!(tally.replayed, keys * shape.retries, "{tally:?}");
    assert_eq!(tally.keys_differ, 0, "{tally:?}");
}

/// Issue 46: SIGTERM, as Kubernetes, systemd and `docker stop` send it, drains the
/// server and shuts its lock client down. An order in flight when the signal arrives is
/// answered (`201`), the process exits successfully and says so, and it leaves no lock
/// and no client name in the store. Before, only Ctrl-C did: SIGTERM killed the process
/// with its locks held until their leases ended.
#[cfg(feature = "redis")]
async fn sigterm_drains_the_orders_in_flight_and_leaves_nothing_in_the_store(
    server: &crate::common::redis_server::RedisServer,
) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let process = Seckill::start(
        &[("REDIS_URL", server.url().as_str())],
        &[
            "--stock",
            "5",
            "--name",
            "seckill-term",
            "--work-ms",
            "1000",
        ],
    )
    .await;
    let client = http_client();
    let in_flight = tokio::spawn({
        let (client, addr) = (client.clone(), process.addr);
        async move { post(&client, addr, 7, "term-1").await }
    });
    crate::common::wait_until(
        Duration::from_secs(10),
        "the order holds its lock",
        || async { !server.keys("seckill:lock:*").await.is_empty() },
    )
    .await;
    let (exited_ok, said) = process.terminate(Duration::from_secs(20)).await;
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "drained: {answer:?}");
    assert!(exited_ok, "seckill did not exit successfully: {said:?}");
    assert!(
        said.iter().any(|line| line.contains("shut down")),
        "no shutdown said: {said:?}"
    );
    let left: Vec<String> = server
        .keys("*")
        .await
        .into_iter()
        .filter(|k| k.starts_with("seckill:lock:") || k.contains("tower_lock_client"))
        .collect();
    assert!(left.is_empty(), "left in the store: {left:?}");
}

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;

    async fn redis() -> Shared {
        Shared::Redis(crate::common::redis_server::RedisServer::start().await)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retries_alternating_between_two_processes_run_the_order_once() {
        super::retries_alternating_between_two_processes_run_the_order_once(redis().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_order_whose_process_is_killed_runs_again_once_its_lease_ends() {
        super::an_order_whose_process_is_killed_runs_again_once_its_lease_ends(redis().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sigterm_drains_the_orders_in_flight_and_leaves_nothing_in_the_store() {
        let server = crate::common::redis_server::RedisServer::start().await;
        super::sigterm_drains_the_orders_in_flight_and_leaves_nothing_in_the_store(&server).await;
    }
}

#[cfg(feature = "postgres")]
mod on_postgres {
    use super::*;

    async fn postgres() -> Shared {
        Shared::Postgres(crate::common::postgres::PgDatabase::create().await)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retries_alternating_between_two_processes_run_the_order_once() {
        super::retries_alternating_between_two_processes_run_the_order_once(postgres().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_order_whose_process_is_killed_runs_again_once_its_lease_ends() {
        super::an_order_whose_process_is_killed_runs_again_once_its_lease_ends(postgres().await)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_processes_on_one_database_sell_once_per_user_and_never_oversell() {
        super::two_processes_on_one_database_sell_once_per_user_and_never_oversell(
            postgres().await,
        )
        .await;
    }
}

#[cfg(feature = "mysql")]
mod on_mysql {
    use super::*;

    async fn mysql() -> Shared {
        Shared::MySql(crate::common::mysql::MyDatabase::create().await)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retries_alternating_between_two_processes_run_the_order_once() {
        super::retries_alternating_between_two_processes_run_the_order_once(mysql().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_order_whose_process_is_killed_runs_again_once_its_lease_ends() {
        super::an_order_whose_process_is_killed_runs_again_once_its_lease_ends(mysql().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_processes_on_one_database_sell_once_per_user_and_never_oversell() {
        super::two_processes_on_one_database_sell_once_per_user_and_never_oversell(mysql().await)
            .await;
    }
}
