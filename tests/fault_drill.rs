//! Issue 44's fault drill: what a fault costs the callers of a `LockLayer`, measured
//! against real servers and printed as one Markdown table (`docs/faults.md` explains
//! it). Run it alone with `cargo test --all-features --test fault_drill -- --nocapture`.
//!
//! Every row has the same setup: an axum router on a real socket, `POST /orders` under
//! a `LockLayer` keyed by `x-user-id` (`order:{1}`), on ONE `LockClient` whose backend
//! counts its store attempts and abandonments ([`Calls`]). A holder (a client of its
//! own on the same store) takes the lock, 20 HTTP/1.1 requests for the same user are
//! sent and wait, the fault happens, the holder's lock goes away (lost with the store,
//! expired, or released, as each row says), and the 20 requests drain. The handler
//! counts who is inside: never two at once.
//!
//! The rows run side by side, each on a thread of its own with a current-thread runtime
//! and servers of its own, so the WARN lines a row's thread logs are that row's (a
//! thread-local subscriber sees every task of its runtime).
//!
//! This test target has no libtest harness (`harness = false`): its `main` runs the
//! drill, prints the table to stdout, and fails (exit code 1) when a row breaks one of
//! the done-when criteria, listed on stderr.

#[path = "it/common/mod.rs"]
mod common;

fn main() -> std::process::ExitCode {
    drill::main()
}

mod drill {
    use std::collections::BTreeMap;
    use std::future::Future;
    use std::pin::Pin;
    use std::process::ExitCode;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use axum::Router;
    use axum::routing::post;
    use bytes::Bytes;
    use http::{HeaderName, Request, StatusCode};
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use sqlx::postgres::{PgPool, PgPoolOptions};
    use tokio::task::JoinHandle;
    use tokio::time::Instant;
    use tower_lock::backend::{
        Acquire, BoxFuture, Intercept, Intercepted, LockBackend, LockRequest, Release,
    };
    use tower_lock::layer::{DEFAULT_REQUEST_LEASE, HeaderKey, LockLayer};
    use tower_lock::{Lease, LockClient, LockKey, PostgresBackend, RedisBackend, Result};

    use super::common;
    use common::clock::ClockShift;
    use common::postgres::PgServer;
    use common::proxy::FaultProxy;
    use common::redis_server::RedisServer;
    use common::sentinel::{MASTER, SentinelSet};

    /// Requests waiting for the lock when the fault happens.
    const WAITERS: usize = 20;
    /// How long the handler works under the lock.
    const WORK: Duration = Duration::from_millis(20);
    /// How long the store's load is counted after it is back.
    const AFTER: Duration = Duration::from_secs(3);
    /// The bound: the first lock granted within this long of the fault's end.
    const FIRST_GRANT_WITHIN: Duration = Duration::from_secs(1);
    /// How often, at most, one cause may be logged at WARN.
    const LOG_INTERVAL: Duration = Duration::from_secs(10);
    /// The outage of row 2.
    const OUTAGE: Duration = Duration::from_secs(10);
    /// How long the waiters go without a store attempt before the fault: they are
    /// settled, waiting for a notification or their holder's lease.
    const SETTLED: Duration = Duration::from_millis(200);
    /// How often the rival of the SIGSTOP rows tries the lock (see [`Drill::rival`]).
    const RIVAL_EVERY: Duration = Duration::from_millis(200);
    /// The clock step of rows 7 to 10.
    const STEP: Duration = Duration::from_secs(5);
    /// What the Redis counts of the table are made of: the calls the lock client makes
    /// itself (scripts, replica acknowledgement, its role checks and pub/sub), not the
    /// Sentinels', the replicas' or the drill's own `INFO`.
    const LOCK_COMMANDS: &[&str] = &[
        "evalsha",
        "eval",
        "evalsha_ro",
        "eval_ro",
        "wait",
        "role",
        "subscribe",
        "unsubscribe",
        "ssubscribe",
        "sunsubscribe",
    ];

    /// The rows, in the table's order.
    fn rows() -> Vec<(&'static str, Scenario)> {
        vec![
            ("Redis restart (SIGKILL, back empty)", || {
                Box::pin(redis_restart())
            }),
            ("Redis outage, 10 s (connections refused)", || {
                Box::pin(redis_outage())
            }),
            ("Sentinel failover, 1 replica, SIGKILL", || {
                Box::pin(failover(1, Stop::Kill))
            }),
            ("Sentinel failover, 2 replicas, SIGKILL", || {
                Box::pin(failover(2, Stop::Kill))
            }),
            ("Sentinel failover, 1 replica, SIGSTOP", || {
                Box::pin(failover(1, Stop::Pause))
            }),
            ("Sentinel failover, 2 replicas, SIGSTOP", || {
                Box::pin(failover(2, Stop::Pause))
            }),
            ("Redis clock +5 s", || Box::pin(redis_clock(Step::Ahead))),
            ("Redis clock −5 s", || Box::pin(redis_clock(Step::Behind))),
            ("PostgreSQL clock +5 s", || Box::pin(pg_clock(Step::Ahead))),
            ("PostgreSQL clock −5 s", || {
                Box::pin(pg_clock(Step::Behind))
            }),
            ("PostgreSQL restart (SIGKILL)", || Box::pin(pg_restart())),
        ]
    }

    type Scenario = fn() -> Pin<Box<dyn Future<Output = Outcome>>>;

    pub(super) fn main() -> ExitCode {
        // Arguments that are row numbers run only those rows (others, such as
        // `--nocapture`, are cargo's and ignored).
        let only: Vec<usize> = std::env::args()
            .skip(1)
            .filter_map(|a| a.parse().ok())
            .collect();
        common::log_capture_sees_every_callsite();
        let started = std::time::Instant::now();
        let threads: Vec<_> = rows()
            .into_iter()
            .enumerate()
            .map(|(i, row)| (i + 1, row))
            .filter(|(n, _)| only.is_empty() || only.contains(n))
            .map(|(n, (fault, scenario))| {
                std::thread::Builder::new()
                    .name(format!("row-{n}"))
                    .spawn(move || run_row(scenario))
                    .map(|thread| (n, fault, thread))
                    .expect("a thread per row")
            })
            .collect();
        let rows: Vec<Row> = threads
            .into_iter()
            .map(|(n, fault, thread)| Row {
                n,
                fault,
                outcome: thread
                    .join()
                    .unwrap_or_else(|panic| Outcome::Failed(panic_message(panic.as_ref()))),
            })
            .collect();
        let took = started.elapsed();
        println!("{}", table(&rows));
        println!("The drill took {:.1} s.", took.as_secs_f64());
        let debug = std::env::var_os(DEBUG).is_some();
        let mut failed = false;
        for row in &rows {
            let broken = row.broken();
            if let Outcome::Measured(m) = &row.outcome {
                for (cause, n) in &m.log.causes {
                    eprintln!("row {}: {n} × {cause}", row.n);
                }
                for note in &m.notes {
                    eprintln!("row {}: {note}", row.n);
                }
                if debug || !broken.is_empty() {
                    eprintln!("row {}, from the fault's end:\n{}", row.n, m.story());
                }
            }
            for failure in &broken {
                eprintln!("FAILED {failure}");
            }
            failed |= !broken.is_empty();
        }
        if failed {
            eprintln!("the fault drill failed: see FAILED above");
            return ExitCode::FAILURE;
        }
        ExitCode::SUCCESS
    }

    /// Set, the drill prints each row's store attempts and DEBUG log, not only those
    /// of a row that breaks a criterion.
    const DEBUG: &str = "FAULT_DRILL_DEBUG";

    fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "a panic".to_owned())
    }

    /// Runs one row on this thread: its own runtime, its own log.
    fn run_row(scenario: Scenario) -> Outcome {
        let log = WarnLog::new(std::env::var_os(DEBUG).is_some());
        let _default = tracing::subscriber::set_default(log.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let started = std::time::Instant::now();
        let mut outcome = runtime.block_on(scenario());
        drop(runtime);
        if let Outcome::Measured(m) = &mut outcome {
            m.log = log.summary(started.elapsed());
        }
        outcome
    }

    // ---------------------------------------------------------------------------------
    // The rows.

    fn key() -> LockKey {
        LockKey::namespaced("order", "1").expect("a valid key")
    }

    /// How many of the layer's requests wait for the lock, on a Redis backend.
    fn redis_waiters(backend: &Intercepted<RedisBackend, Calls>) -> impl Fn() -> usize + use<> {
        let backend = backend.clone();
        move || backend.inner().local_waiters(&key())
    }

    /// How many of the layer's requests wait for the lock, on a PostgreSQL backend.
    fn pg_waiters(backend: &Intercepted<PostgresBackend, Calls>) -> impl Fn() -> usize + use<> {
        let backend = backend.clone();
        move || backend.inner().local_waiters(&key())
    }

    /// 1. The server SIGKILLed and started again on its port, empty: the holder's lock
    ///    goes with it.
    async fn redis_restart() -> Outcome {
        let mut server = RedisServer::start().await;
        let calls = Calls::default();
        let backend = Intercepted::new(
            RedisBackend::connect(server.url()).await.unwrap(),
            calls.clone(),
        );
        let holder = Holder::take(
            Lease::Renewed(DEFAULT_REQUEST_LEASE),
            redis_holder(server.url()),
        )
        .await;
        let waiting = redis_waiters(&backend);
        let mut drill = Drill::start(LockClient::new(backend), calls, waiting).await;
        drill.fault_begins();
        server.restart().await;
        let back = drill.fault_ends();
        let commands = tokio::spawn(redis_commands(server.port(), back));
        let figures = drill.finish(commands).await;
        drop(holder); // its lock went with the server
        Outcome::Measured(figures)
    }

    /// 2. Connections refused for 10 s (a proxy in front of Redis refuses new ones and
    ///    cuts the open ones); the holder's 2 s lease ends in the outage.
    async fn redis_outage() -> Outcome {
        let server = RedisServer::start().await;
        let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
        let calls = Calls::default();
        let through = format!("redis://127.0.0.1:{}", proxy.port());
        let backend =
            Intercepted::new(RedisBackend::connect(through).await.unwrap(), calls.clone());
        let holder = Holder::take(
            Lease::Fixed(Duration::from_secs(2)),
            redis_holder(server.url()),
        )
        .await;
        let waiting = redis_waiters(&backend);
        let mut drill = Drill::start(LockClient::new(backend), calls, waiting).await;
        drill.fault_begins();
        proxy.refuse(true);
        proxy.cut();
        // The fault itself lasts this long.
        tokio::time::sleep(OUTAGE).await;
        proxy.refuse(false);
        let back = drill.fault_ends();
        let commands = tokio::spawn(redis_commands(server.port(), back));
        let figures = drill.finish(commands).await;
        drop(holder); // its lease ended in the outage
        Outcome::Measured(figures)
    }

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Stop {
        Kill,
        Pause,
    }

    /// 3 to 6. The primary behind three Sentinels SIGKILLed, or SIGSTOPped and thawed
    ///    once the Sentinels agree on its successor; the fault ends when they agree. The
    ///    holder's lease, the Sentinels' down time (1 s), ends before a replica can be
    ///    promoted.
    async fn failover(replicas: usize, stop: Stop) -> Outcome {
        let mut set = SentinelSet::start(replicas, 3).await;
        let urls = set.sentinel_urls();
        let calls = Calls::default();
        let backend = Intercepted::new(
            RedisBackend::sentinel(MASTER, urls.clone())
                .build()
                .await
                .unwrap(),
            calls.clone(),
        );
        let old = set.primary_port().await;
        let holder = Holder::take(
            Lease::Fixed(common::sentinel::DOWN_AFTER),
            sentinel_holder(urls),
        )
        .await;
        let waiting = redis_waiters(&backend);
        let mut drill = Drill::start(LockClient::new(backend), calls, waiting).await;
        drill.fault_begins();
        match stop {
            Stop::Kill => set.node(old).kill(),
            Stop::Pause => set.node(old).pause(),
        }
        if stop == Stop::Pause && std::env::var_os(DEBUG).is_some() {
            // What the old primary runs once it is thawed, in the row's story.
            drill.monitor(old).await;
        }
        let new = set.wait_for_new_primary(old, Duration::from_secs(30)).await;
        let agreed = drill.fault_ends();
        if stop == Stop::Pause {
            // Another instance of the application, on the new primary, takes the lock
            // whenever it can: were the old primary to grant it too once thawed, the
            // rival and a request would be inside at once.
            let rival = RedisBackend::connect(format!("redis://127.0.0.1:{new}"))
                .await
                .unwrap();
            drill.rival(LockClient::new(rival));
            let ports: Vec<u16> = set.nodes.iter().map(|n| n.port()).collect();
            let sentinels: Vec<u16> = set.sentinels.iter().map(|s| s.port()).collect();
            drill.watch_roles(ports, sentinels);
            set.node(old).resume();
        }
        let commands = tokio::spawn(redis_commands(new, agreed));
        let figures = drill.finish(commands).await;
        drop(holder); // its lease ended in the failover
        Outcome::Measured(figures)
    }

    #[derive(Clone, Copy)]
    enum Step {
        Ahead,
        Behind,
    }

    impl Step {
        fn apply(self, clock: &ClockShift) {
            match self {
                Step::Ahead => clock.ahead(STEP),
                Step::Behind => clock.behind(STEP),
            }
        }
    }

    /// 7, 8. The server's wall clock stepped 5 s; the holder releases at once.
    async fn redis_clock(step: Step) -> Outcome {
        let clock = ClockShift::new();
        let server = RedisServer::start_with_env(&[], clock.env()).await;
        let calls = Calls::default();
        let backend = Intercepted::new(
            RedisBackend::connect(server.url()).await.unwrap(),
            calls.clone(),
        );
        let mut holder = Holder::take(
            Lease::Renewed(DEFAULT_REQUEST_LEASE),
            redis_holder(server.url()),
        )
        .await;
        let waiting = redis_waiters(&backend);
        let mut drill = Drill::start(LockClient::new(backend), calls, waiting).await;
        drill.step_begins();
        step.apply(&clock);
        let stepped = drill.fault_ends();
        let commands = tokio::spawn(redis_commands(server.port(), stepped));
        drill.release(&mut holder).await;
        Outcome::Measured(drill.finish(commands).await)
    }

    /// What the Sentinel on `port` says of the primary: the address
    /// `GET-MASTER-ADDR-BY-NAME` answers, and the port and flags of its entry in
    /// `SENTINEL MASTERS` (which clients such as redis-rs read).
    async fn sentinel_names(port: u16) -> Option<String> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let (_, named): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER)
            .query_async(&mut conn)
            .await
            .ok()?;
        let entry: std::collections::HashMap<String, String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(MASTER)
            .query_async(&mut conn)
            .await
            .ok()?;
        let field = |name: &str| entry.get(name).cloned().unwrap_or_default();
        Some(format!(
            "{named}; its MASTERS entry: {} {}",
            field("port"),
            field("flags")
        ))
    }

    /// A PostgreSQL server of the row's own, or why there is none.
    async fn pg_server(env: Vec<(String, String)>) -> Option<PgServer> {
        tokio::task::spawn_blocking(move || PgServer::start_with_env(env))
            .await
            .expect("starting PostgreSQL")
    }

    async fn pg_pool(url: &str) -> PgPool {
        PgPoolOptions::new()
            .max_connections(10)
            .connect(url)
            .await
            .unwrap()
    }

    async fn pg_backend(pool: &PgPool) -> PostgresBackend {
        PostgresBackend::builder(pool.clone())
            .build()
            .await
            .unwrap()
    }

    const NO_POSTGRES: &str = "skipped: no PostgreSQL server binaries (.ci/run installs them)";

    /// 9, 10. The database server's wall clock stepped 5 s; the holder releases at once.
    async fn pg_clock(step: Step) -> Outcome {
        let clock = ClockShift::new();
        let Some(server) = pg_server(clock.env()).await else {
            return Outcome::Skipped(NO_POSTGRES);
        };
        let pool = pg_pool(&server.url()).await;
        let calls = Calls::default();
        let backend = Intercepted::new(pg_backend(&pool).await, calls.clone());
        let mut holder = Holder::take(
            Lease::Renewed(DEFAULT_REQUEST_LEASE),
            pg_holder(server.url()),
        )
        .await;
        let waiting = pg_waiters(&backend);
        let mut drill = Drill::start(LockClient::new(backend), calls, waiting).await;
        let counter = PgCounter::new(&server).await;
        let before = counter.settled(std::slice::from_ref(&pool)).await;
        drill.step_begins();
        step.apply(&clock);
        let stepped = drill.fault_ends();
        let commands = tokio::spawn(counter.since(before, stepped, pool));
        drill.release(&mut holder).await;
        let figures = drill.finish(commands).await;
        drop(server);
        Outcome::Measured(figures)
    }

    /// 11. The database server SIGKILLed and started again (crash recovery); the fault
    ///     ends when it answers a query. The holder's lock outlives the crash (a grant
    ///     is durable); the holder releases it then.
    async fn pg_restart() -> Outcome {
        let Some(server) = pg_server(Vec::new()).await else {
            return Outcome::Skipped(NO_POSTGRES);
        };
        let pool = pg_pool(&server.url()).await;
        let calls = Calls::default();
        let backend = Intercepted::new(pg_backend(&pool).await, calls.clone());
        let mut holder = Holder::take(
            Lease::Renewed(DEFAULT_REQUEST_LEASE),
            pg_holder(server.url()),
        )
        .await;
        let waiting = pg_waiters(&backend);
        let mut drill = Drill::start(LockClient::new(backend), calls, waiting).await;
        drill.fault_begins();
        let server = tokio::task::spawn_blocking(move || {
            let mut server = server;
            server.restart();
            server
        })
        .await
        .expect("restarting PostgreSQL");
        let url = server.url();
        common::wait_until(Duration::from_secs(30), "PostgreSQL answers", || {
            answers(&url)
        })
        .await;
        let back = drill.fault_ends();
        // Every session of before the crash is gone, and with it what it had not yet
        // published: the count read now is settled.
        let counter = PgCounter::new(&server).await;
        let before = counter.settled(&[]).await;
        let commands = tokio::spawn(counter.since(before, back, pool));
        drill.release(&mut holder).await;
        let figures = drill.finish(commands).await;
        drop(server);
        Outcome::Measured(figures)
    }

    async fn answers(url: &str) -> bool {
        use sqlx::Connection;
        let Ok(mut conn) = sqlx::PgConnection::connect(url).await else {
            return false;
        };
        let answered = sqlx::query("SELECT 1").execute(&mut conn).await.is_ok();
        let _ = conn.close().await;
        answered
    }

    // ---------------------------------------------------------------------------------
    // The holder: another process on the same store.

    /// Makes the holder's client, on the holder's runtime; with the PostgreSQL pools
    /// whose counts are to be settled ([`PgCounter`]).
    type Connect =
        Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = (LockClient, Vec<PgPool>)>>> + Send>;

    fn redis_holder(url: String) -> Connect {
        Box::new(move || {
            Box::pin(async move {
                let backend = RedisBackend::connect(url).await.unwrap();
                (LockClient::new(backend), Vec::new())
            })
        })
    }

    fn sentinel_holder(sentinels: Vec<String>) -> Connect {
        Box::new(move || {
            Box::pin(async move {
                let backend = RedisBackend::sentinel(MASTER, sentinels)
                    .build()
                    .await
                    .unwrap();
                (LockClient::new(backend), Vec::new())
            })
        })
    }

    fn pg_holder(url: String) -> Connect {
        Box::new(move || {
            Box::pin(async move {
                let pool = pg_pool(&url).await;
                (LockClient::new(pg_backend(&pool).await), vec![pool])
            })
        })
    }

    type ReleaseOrder = tokio::sync::oneshot::Sender<std::result::Result<(), String>>;

    /// The lock's holder: a client of its own on a thread and runtime of its own, as
    /// another process would be, so that its log is not the row's. Dropped, it lets
    /// its lock go with the store or its lease.
    struct Holder {
        orders: tokio::sync::mpsc::UnboundedSender<ReleaseOrder>,
    }

    impl Holder {
        /// A holder that has taken the lock, at once, with `lease`.
        async fn take(lease: Lease, connect: Connect) -> Holder {
            let (taken, was_taken) = tokio::sync::oneshot::channel();
            let (orders, mut told) = tokio::sync::mpsc::unbounded_channel::<ReleaseOrder>();
            let holder = move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                runtime.block_on(async move {
                    let (client, pools) = connect().await;
                    let guard = client
                        .get_lock(key())
                        .unwrap()
                        .try_lock_for(Duration::ZERO, lease)
                        .await
                        .expect("the holder takes the free lock");
                    settle(&pools).await;
                    let _ = taken.send(());
                    let Some(done) = told.recv().await else {
                        std::mem::forget(guard);
                        return;
                    };
                    let released = guard.unlock().await.map_err(|e| e.to_string());
                    // Its sessions end, publishing their counts.
                    for pool in pools {
                        pool.close().await;
                    }
                    let _ = done.send(released);
                });
            };
            std::thread::Builder::new()
                .name("holder".into())
                .spawn(holder)
                .expect("a holder thread");
            was_taken.await.expect("the holder takes the lock");
            Holder { orders }
        }

        /// Releases the lock.
        async fn release(&mut self) -> std::result::Result<(), String> {
            let (done, released) = tokio::sync::oneshot::channel();
            let gone = || "the holder is gone".to_owned();
            self.orders.send(done).map_err(|_| gone())?;
            released.await.map_err(|_| gone())?
        }
    }

    // ---------------------------------------------------------------------------------
    // One row's run.

    /// Counts the store calls the layer's client makes, acquisitions and abandonments,
    /// and keeps each acquisition, release and abandonment with its answer in the row's
    /// story (printed for a row that breaks a criterion).
    #[derive(Clone, Default)]
    struct Calls {
        acquires: Arc<AtomicUsize>,
        abandons: Arc<AtomicUsize>,
        timeline: Arc<Mutex<Vec<Attempt>>>,
    }

    /// A line of the row's story: a store call (when sent and answered) or an event.
    struct Attempt {
        sent: Instant,
        answered: Instant,
        answer: String,
    }

    impl Calls {
        fn acquires(&self) -> usize {
            self.acquires.load(Ordering::SeqCst)
        }
        fn abandons(&self) -> usize {
            self.abandons.load(Ordering::SeqCst)
        }

        /// Runs `call`, keeping when it was sent and answered, and its answer.
        fn timed<'a, T: std::fmt::Debug + Send + 'a>(
            &'a self,
            what: &'static str,
            req: &'a LockRequest,
            call: BoxFuture<'a, Result<T>>,
        ) -> BoxFuture<'a, Result<T>> {
            Box::pin(async move {
                let sent = Instant::now();
                let answer = call.await;
                let text = match &answer {
                    Ok(answer) => format!("{what} {}: {answer:?}", req.hold_id),
                    Err(error) => format!("{what} {}: error: {error}", req.hold_id),
                };
                self.timeline.lock().unwrap().push(Attempt {
                    sent,
                    answered: Instant::now(),
                    answer: text,
                });
                answer
            })
        }
    }

    impl<B: LockBackend> Intercept<B> for Calls {
        fn acquire<'a>(
            &'a self,
            inner: &'a B,
            req: &'a LockRequest,
        ) -> BoxFuture<'a, Result<Acquire>> {
            self.acquires.fetch_add(1, Ordering::SeqCst);
            self.timed("acquire", req, inner.acquire(req))
        }
        fn abandon<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
            self.abandons.fetch_add(1, Ordering::SeqCst);
            self.timed("abandon", req, inner.abandon(req))
        }
        fn release<'a>(
            &'a self,
            inner: &'a B,
            req: &'a LockRequest,
        ) -> BoxFuture<'a, Result<Release>> {
            self.timed("release", req, inner.release(req))
        }
    }

    /// Backoff steps (20 ms doubling to 1 s) that start within `window`, plus the
    /// attempt that met the fault first: what one waiter may cost the store over it.
    fn attempts_allowed(window: Duration) -> usize {
        let (mut at, mut step, mut n) = (Duration::ZERO, Duration::from_millis(20), 1);
        while at < window {
            at += step;
            step = (step * 2).min(Duration::from_secs(1));
            n += 1;
        }
        n
    }

    /// What the handler saw.
    #[derive(Default)]
    struct Inside {
        now: AtomicUsize,
        most: AtomicUsize,
        /// The first request's entry, and the store attempts made by then.
        first: Mutex<Option<(Instant, usize)>>,
    }

    /// A moment of the drill, with the client's calls by then.
    #[derive(Clone, Copy)]
    struct Mark {
        at: Instant,
        acquires: usize,
        abandons: usize,
    }

    struct Drill {
        calls: Calls,
        inside: Arc<Inside>,
        _server: common::Server,
        requests: Vec<JoinHandle<u16>>,
        began: Option<Mark>,
        ended: Option<Mark>,
        notes: Vec<String>,
        /// Kept until the requests are answered.
        _client: LockClient,
        /// The fault is a clock step: it ends as it begins.
        clock_step: bool,
        /// The rival's task (see [`Drill::rival`]), stopped once the requests are
        /// answered, and how often it had the lock.
        rival: Option<(JoinHandle<usize>, Arc<std::sync::atomic::AtomicBool>)>,
    }

    impl Drill {
        /// Serves the layer on `client`, sends the requests while the holder holds the
        /// lock, and returns once `waiting()` counts all of them waiting.
        async fn start(client: LockClient, calls: Calls, waiting: impl Fn() -> usize) -> Self {
            let inside = Arc::new(Inside::default());
            let server = serve_orders(&client, &inside, &calls).await;
            let requests = send_requests(server.addr);
            common::wait_until(
                Duration::from_secs(10),
                "every request waits for the lock",
                || {
                    let n = waiting();
                    async move { n == WAITERS }
                },
            )
            .await;
            // A waiter registered may still try again once its subscription is
            // confirmed: the fault comes once they have all settled, so that what
            // they try after it is the fault's doing.
            let mut last = (calls.acquires(), Instant::now());
            common::wait_until(
                Duration::from_secs(10),
                "the waiters settle (no store attempt for 200 ms)",
                || {
                    let now = calls.acquires();
                    if now != last.0 {
                        last = (now, Instant::now());
                    }
                    let settled = last.1.elapsed() >= SETTLED;
                    async move { settled }
                },
            )
            .await;
            Drill {
                calls,
                inside,
                _server: server,
                requests,
                began: None,
                ended: None,
                notes: Vec::new(),
                _client: client,
                clock_step: false,
                rival: None,
            }
        }

        fn mark(&self) -> Mark {
            Mark {
                at: Instant::now(),
                acquires: self.calls.acquires(),
                abandons: self.calls.abandons(),
            }
        }

        /// The fault is a clock step, done at once: it has no duration.
        fn step_begins(&mut self) {
            self.clock_step = true;
            self.fault_begins();
        }

        fn fault_begins(&mut self) {
            assert!(
                self.inside.first.lock().unwrap().is_none(),
                "a request got the lock before the fault: the setup outlasted the holder's lease"
            );
            self.began = Some(self.mark());
        }

        /// The fault is over: the store answers again (or the clock has stepped).
        fn fault_ends(&mut self) -> Instant {
            let began = self.began.expect("the fault began");
            // A clock step has no duration: it ends as it begins.
            let ended = if self.clock_step { began } else { self.mark() };
            self.ended = Some(ended);
            ended.at
        }

        /// A rival client takes the lock whenever it can, in turn with the requests,
        /// and is counted inside the handler as a request is, until every request is
        /// answered: a request and the rival inside at once are two holders.
        fn rival(&mut self, rival: LockClient) {
            let inside = self.inside.clone();
            let timeline = self.calls.timeline.clone();
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let stop = done.clone();
            let task = tokio::spawn(async move {
                let lock = rival.get_lock(key()).unwrap();
                let mut grants = 0;
                while !stop.load(Ordering::SeqCst) {
                    let lease = Lease::Fixed(Duration::from_secs(2));
                    if let Ok(guard) = lock.try_lock_for(Duration::ZERO, lease).await {
                        grants += 1;
                        let at = Instant::now();
                        timeline.lock().unwrap().push(Attempt {
                            sent: at,
                            answered: at,
                            answer: format!("the rival has the lock ({})", guard.hold_id()),
                        });
                        let n = inside.now.fetch_add(1, Ordering::SeqCst) + 1;
                        inside.most.fetch_max(n, Ordering::SeqCst);
                        tokio::time::sleep(WORK).await;
                        inside.now.fetch_sub(1, Ordering::SeqCst);
                        let _ = guard.unlock().await;
                    }
                    tokio::time::sleep(RIVAL_EVERY).await;
                }
                grants
            });
            self.rival = Some((task, done));
        }

        /// Notes in the row's story every command the Redis server on `port` runs from
        /// now on (`MONITOR`), but the Sentinels' and the replicas' own.
        async fn monitor(&mut self, port: u16) {
            use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
            let timeline = self.calls.timeline.clone();
            let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("a connection to monitor");
            conn.write_all(b"MONITOR\r\n").await.unwrap();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(conn).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let ignored = ["\"PING\"", "\"INFO\"", "\"PUBLISH\"", "\"REPLCONF\"", "+OK"];
                    if ignored.iter().any(|i| line.contains(i)) {
                        continue;
                    }
                    let at = Instant::now();
                    let line: String = line.chars().take(160).collect();
                    timeline.lock().unwrap().push(Attempt {
                        sent: at,
                        answered: at,
                        answer: format!("old primary runs {line}"),
                    });
                }
            });
        }

        /// Notes in the row's story each change of the data nodes' replication (role,
        /// primary, link, replicas online) until the requests are answered.
        fn watch_roles(&mut self, ports: Vec<u16>, sentinels: Vec<u16>) {
            let timeline = self.calls.timeline.clone();
            let done = match &self.rival {
                Some((_, done)) => done.clone(),
                None => return,
            };
            tokio::spawn(async move {
                let mut seen = vec![String::new(); ports.len()];
                let mut named = vec![String::new(); sentinels.len()];
                while !done.load(Ordering::SeqCst) {
                    for (port, named) in sentinels.iter().zip(&mut named) {
                        let asked = sentinel_names(*port).await.unwrap_or_default();
                        if asked != *named {
                            let at = Instant::now();
                            timeline.lock().unwrap().push(Attempt {
                                sent: at,
                                answered: at,
                                answer: format!("Sentinel {port} names {asked}"),
                            });
                            *named = asked;
                        }
                    }
                    for (port, seen) in ports.iter().zip(&mut seen) {
                        let info = common::sentinel::info_replication(*port)
                            .await
                            .unwrap_or_else(|| "no answer".to_owned());
                        let state: Vec<&str> = info
                            .lines()
                            .map(str::trim)
                            .filter(|l| {
                                ["role:", "master_port:", "master_link_status:", "slave"]
                                    .iter()
                                    .any(|p| l.starts_with(p))
                                    && !l.starts_with("slave_")
                            })
                            .collect();
                        let state = state.join(" ");
                        if state != *seen {
                            let at = Instant::now();
                            timeline.lock().unwrap().push(Attempt {
                                sent: at,
                                answered: at,
                                answer: format!("node {port}: {state}"),
                            });
                            *seen = state;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            });
        }

        /// The holder releases its lock.
        async fn release(&mut self, holder: &mut Holder) {
            let at = Instant::now();
            if let Err(error) = holder.release().await {
                self.notes
                    .push(format!("the holder's release failed: {error}"));
            }
            self.notes.push(format!(
                "the holder's release took {} ms",
                at.elapsed().as_millis()
            ));
        }

        /// Waits for every answer and for the store's count of `AFTER`; the figures.
        async fn finish(self, commands: JoinHandle<Option<u64>>) -> Figures {
            let mut statuses = BTreeMap::new();
            for request in self.requests {
                *statuses.entry(request.await.unwrap_or(0)).or_default() += 1;
            }
            let commands = commands.await.unwrap_or(None);
            let mut notes = self.notes;
            if let Some((task, done)) = self.rival {
                done.store(true, Ordering::SeqCst);
                let grants = task.await.expect("the rival");
                notes.push(format!(
                    "the rival on the new primary had the lock {grants} times"
                ));
            }
            let began = self.began.expect("the fault began");
            let ended = self.ended.expect("the fault ended");
            let first = *self.inside.first.lock().unwrap();
            // The fault; a clock step, which has no duration, until the first grant.
            let (until, acquires) = match first {
                Some((at, acquires)) if ended.at == began.at && at > ended.at => (at, acquires),
                _ => (ended.at, ended.acquires),
            };
            let window = until - began.at;
            notes.push(format!(
                "the fault lasted {} ms; {} abandonments in it",
                (ended.at - began.at).as_millis(),
                ended.abandons - began.abandons
            ));
            Figures {
                first_grant: first.map(|(at, _)| signed_ms(at, ended.at)),
                attempts: acquires - began.acquires,
                allowed: attempts_allowed(window) * WAITERS,
                commands,
                statuses,
                most_inside: self.inside.most.load(Ordering::SeqCst),
                notes,
                log: LogSummary::default(),
                began: began.at,
                ended: ended.at,
                timeline: std::mem::take(&mut *self.calls.timeline.lock().unwrap()),
            }
        }
    }

    /// `POST /orders` under the layer on `client`, served on a free port: the handler
    /// notes the first entry (with the store attempts by then) and who is inside.
    async fn serve_orders(
        client: &LockClient,
        inside: &Arc<Inside>,
        calls: &Calls,
    ) -> common::Server {
        let handler = {
            let (inside, calls) = (inside.clone(), calls.clone());
            move || {
                let (inside, calls) = (inside.clone(), calls.clone());
                async move {
                    inside
                        .first
                        .lock()
                        .unwrap()
                        .get_or_insert_with(|| (Instant::now(), calls.acquires()));
                    let n = inside.now.fetch_add(1, Ordering::SeqCst) + 1;
                    inside.most.fetch_max(n, Ordering::SeqCst);
                    tokio::time::sleep(WORK).await;
                    inside.now.fetch_sub(1, Ordering::SeqCst);
                    StatusCode::OK
                }
            }
        };
        let keys = HeaderKey::new(HeaderName::from_static("x-user-id"))
            .namespace("order")
            .unwrap();
        let layer = LockLayer::builder(client.clone(), keys)
            .max_wait(Duration::from_secs(30))
            .build()
            .unwrap();
        common::serve(Router::new().route("/orders", post(handler)).layer(layer)).await
    }

    /// The [`WAITERS`] requests for user 1, each its answer's status (0: none, a
    /// transport error or no answer within a minute).
    fn send_requests(addr: std::net::SocketAddr) -> Vec<JoinHandle<u16>> {
        let http = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let url = format!("http://{addr}/orders");
        (0..WAITERS)
            .map(|_| {
                let (http, url) = (http.clone(), url.clone());
                tokio::spawn(async move {
                    let request = Request::post(url)
                        .header("x-user-id", "1")
                        .body(Empty::new())
                        .unwrap();
                    let answered = tokio::time::timeout(Duration::from_secs(60), async {
                        let response = http.request(request).await.ok()?;
                        let status = response.status().as_u16();
                        response.into_body().collect().await.ok()?;
                        Some(status)
                    });
                    answered.await.ok().flatten().unwrap_or(0)
                })
            })
            .collect()
    }

    /// `at - since` in milliseconds, negative when `at` came first.
    fn signed_ms(at: Instant, since: Instant) -> f64 {
        if at >= since {
            (at - since).as_secs_f64() * 1e3
        } else {
            -(since - at).as_secs_f64() * 1e3
        }
    }

    // ---------------------------------------------------------------------------------
    // What the store received in the `AFTER` seconds after the fault's end.

    /// Lock commands the Redis server on `port` received from `since` for `AFTER`.
    async fn redis_commands(port: u16, since: Instant) -> Option<u64> {
        let before = redis_lock_commands(port).await?;
        tokio::time::sleep_until(since + AFTER).await;
        let after = redis_lock_commands(port).await?;
        // The INFO call itself is not a lock command: nothing of the drill's to subtract.
        Some(after.saturating_sub(before))
    }

    /// Calls of [`LOCK_COMMANDS`] received so far (executed or rejected), from `INFO
    /// commandstats`.
    async fn redis_lock_commands(port: u16) -> Option<u64> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .ok()?;
        let stat = |fields: &str, name: &str| -> u64 {
            fields
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
                .unwrap_or(0)
        };
        Some(
            info.lines()
                .filter_map(|l| l.strip_prefix("cmdstat_")?.split_once(':'))
                .filter(|(name, _)| LOCK_COMMANDS.contains(name))
                .map(|(_, fields)| stat(fields, "calls") + stat(fields, "rejected_calls"))
                .sum(),
        )
    }

    /// Transactions of a PostgreSQL server's database (`xact_commit + xact_rollback` of
    /// `pg_stat_database`), read so that what sessions have not yet published counts:
    /// a session publishes at most once a second, and an idle one within 10 s, unless it
    /// is asked to at its next statement (`pg_stat_force_next_flush()`).
    struct PgCounter {
        probe: PgPool,
    }

    impl PgCounter {
        async fn new(server: &PgServer) -> Self {
            let probe = PgPoolOptions::new()
                .max_connections(1)
                .connect(&server.url())
                .await
                .unwrap();
            PgCounter { probe }
        }

        /// The count, once the idle sessions of `pools` and the probe's own have
        /// published theirs; and how many transactions that publishing took.
        async fn settled(&self, pools: &[PgPool]) -> (i64, i64) {
            let own = settle(pools).await;
            let mut probe = self.probe.acquire().await.unwrap();
            assert!(flush(&mut probe).await, "the probe publishes its count");
            let count: i64 = sqlx::query_scalar(
                "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
                 WHERE datname = current_database()",
            )
            .fetch_one(&mut *probe)
            .await
            .unwrap();
            // The probe's flush and its read.
            (count, own + 2)
        }

        /// Transactions from `before` to `since + AFTER`, the drill's own left out.
        async fn since(self, before: (i64, i64), since: Instant, pool: PgPool) -> Option<u64> {
            tokio::time::sleep_until(since + AFTER).await;
            let (after, own) = self.settled(&[pool]).await;
            u64::try_from(after - before.0 - own).ok()
        }
    }

    /// Has every idle session of `pools` publish its counts; how many transactions
    /// that took.
    async fn settle(pools: &[PgPool]) -> i64 {
        let mut own = 0;
        for pool in pools {
            let mut idle = Vec::new();
            while let Some(conn) = pool.try_acquire() {
                idle.push(conn);
            }
            for conn in &mut idle {
                if flush(conn).await {
                    own += 1;
                }
            }
        }
        own
    }

    /// Asks the session of `conn` to publish its counts at the end of this statement.
    async fn flush(conn: &mut sqlx::PgConnection) -> bool {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(conn)
            .await
            .is_ok()
    }

    // ---------------------------------------------------------------------------------
    // The WARN lines of a row.

    /// A subscriber that keeps the WARN (and ERROR) events of its thread, and DEBUG and
    /// INFO too when asked: when, level, target, message and fields.
    #[derive(Clone)]
    struct WarnLog {
        lines: Arc<Mutex<Vec<Logged>>>,
        spans: Arc<AtomicU64>,
        most: tracing::Level,
    }

    struct Logged {
        at: Instant,
        level: tracing::Level,
        target: String,
        message: String,
        fields: String,
    }

    impl WarnLog {
        fn new(debug: bool) -> Self {
            WarnLog {
                lines: Arc::default(),
                spans: Arc::default(),
                most: if debug {
                    tracing::Level::DEBUG
                } else {
                    tracing::Level::WARN
                },
            }
        }
    }

    #[derive(Default)]
    struct EventText {
        message: String,
        fields: String,
    }

    impl tracing::field::Visit for EventText {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.message = format!("{value:?}");
            } else {
                self.fields
                    .push_str(&format!(" {}={value:?}", field.name()));
            }
        }
    }

    impl tracing::Subscriber for WarnLog {
        fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
            *metadata.level() <= self.most
        }
        fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
            Some(tracing::level_filters::LevelFilter::from_level(self.most))
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(self.spans.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut text = EventText::default();
            event.record(&mut text);
            self.lines.lock().unwrap().push(Logged {
                at: Instant::now(),
                level: *event.metadata().level(),
                target: event.metadata().target().to_owned(),
                message: text.message,
                fields: text.fields,
            });
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// A row's log: its WARN lines by cause (level, target and message).
    #[derive(Default)]
    struct LogSummary {
        lines: usize,
        causes: Vec<(String, usize)>,
        /// How many lines one cause may have had over the row's run.
        allowed_per_cause: usize,
        /// Every line kept, with its time.
        text: Vec<(Instant, String)>,
    }

    impl WarnLog {
        fn summary(&self, run: Duration) -> LogSummary {
            let lines = self.lines.lock().unwrap();
            let warnings: Vec<_> = lines
                .iter()
                .filter(|l| l.level <= tracing::Level::WARN)
                .collect();
            let mut causes = BTreeMap::<String, usize>::new();
            for line in &warnings {
                let cause = format!("{} {}: {}", line.level, line.target, line.message);
                *causes.entry(cause).or_default() += 1;
            }
            let mut causes: Vec<_> = causes.into_iter().collect();
            causes.sort_by_key(|c| std::cmp::Reverse(c.1));
            let intervals = (run.as_secs_f64() / LOG_INTERVAL.as_secs_f64()).floor() as usize;
            LogSummary {
                lines: warnings.len(),
                causes,
                allowed_per_cause: 1 + intervals,
                text: lines
                    .iter()
                    .map(|l| {
                        let line = format!("{} {}: {}{}", l.level, l.target, l.message, l.fields);
                        (l.at, line)
                    })
                    .collect(),
            }
        }
    }

    // ---------------------------------------------------------------------------------
    // The table and the criteria.

    enum Outcome {
        Measured(Figures),
        Skipped(&'static str),
        Failed(String),
    }

    struct Figures {
        /// Milliseconds from the fault's end to the first request in the handler.
        first_grant: Option<f64>,
        /// Store attempts of the waiters during the fault (a clock step: from the step
        /// to the first grant), and how many the backoff allows over that time.
        attempts: usize,
        allowed: usize,
        /// What the store received in the `AFTER` seconds after the fault's end: Redis
        /// [`LOCK_COMMANDS`], PostgreSQL transactions.
        commands: Option<u64>,
        statuses: BTreeMap<u16, usize>,
        most_inside: usize,
        notes: Vec<String>,
        log: LogSummary,
        /// When the fault began and ended, and the layer's store attempts.
        began: Instant,
        ended: Instant,
        timeline: Vec<Attempt>,
    }

    impl Figures {
        /// The store attempts and the log lines of the row, in order, in milliseconds
        /// from the fault's end.
        fn story(&self) -> String {
            let ms = |at: Instant| signed_ms(at, self.ended);
            let mut story: Vec<(f64, String)> = self
                .timeline
                .iter()
                .map(|a| {
                    let took = (a.answered - a.sent).as_millis();
                    (ms(a.sent), format!("({took} ms) {}", a.answer))
                })
                .chain(
                    self.log
                        .text
                        .iter()
                        .map(|(at, line)| (ms(*at), line.clone())),
                )
                .collect();
            story.push((ms(self.began), "the fault begins".to_owned()));
            story.push((0.0, "the fault ends".to_owned()));
            if let Some(first) = self.first_grant {
                story.push((first, "the first request enters the handler".to_owned()));
            }
            story.sort_by(|a, b| a.0.total_cmp(&b.0));
            story
                .iter()
                .map(|(at, what)| format!("  {at:>8.0} ms  {what}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
    }

    struct Row {
        n: usize,
        fault: &'static str,
        outcome: Outcome,
    }

    impl Row {
        /// The done-when criteria this row breaks.
        fn broken(&self) -> Vec<String> {
            let m = match &self.outcome {
                Outcome::Measured(m) => m,
                Outcome::Skipped(_) => return Vec::new(),
                Outcome::Failed(why) => return vec![format!("row {}: {why}", self.n)],
            };
            let mut broken = Vec::new();
            let mut check = |ok: bool, what: String| {
                if !ok {
                    broken.push(format!("row {} ({}): {what}", self.n, self.fault));
                }
            };
            let bound = FIRST_GRANT_WITHIN.as_secs_f64() * 1e3;
            check(
                m.first_grant.is_some_and(|ms| ms <= bound),
                format!(
                    "first grant {} after the fault's end, at most {bound} ms",
                    m.first_grant
                        .map_or("never".into(), |ms| format!("{ms:.0} ms"))
                ),
            );
            check(
                m.attempts <= m.allowed,
                format!(
                    "{} store attempts by {WAITERS} waiters, at most {} (one per backoff step)",
                    m.attempts, m.allowed
                ),
            );
            let errors = m.statuses.get(&500).copied().unwrap_or(0);
            check(errors == 0, format!("{errors} responses 500"));
            check(
                m.statuses.get(&200) == Some(&WAITERS),
                format!("responses {:?}, all {WAITERS} 200", m.statuses),
            );
            check(
                m.most_inside == 1,
                format!("{} requests in the handler at once", m.most_inside),
            );
            for (cause, n) in &m.log.causes {
                check(
                    *n <= m.log.allowed_per_cause,
                    format!(
                        "{n} lines of one cause, at most {} (one per {} s): {cause}",
                        m.log.allowed_per_cause,
                        LOG_INTERVAL.as_secs(),
                    ),
                );
            }
            broken
        }
    }

    fn table(rows: &[Row]) -> String {
        let mut out = String::from(
            "| # | Fault | First grant after the fault's end | Store attempts per waiter (allowed) \
             | Store load in the 3 s after | WARN lines (most of one cause) | 500s \
             | Most holders at once |\n\
             |---|---|--:|--:|--:|--:|--:|--:|\n",
        );
        for row in rows {
            let cells = match &row.outcome {
                Outcome::Measured(m) => {
                    let first = m
                        .first_grant
                        .map_or("none".to_owned(), |ms| format!("{ms:.0} ms"));
                    let per_waiter = m.attempts as f64 / WAITERS as f64;
                    let allowed = m.allowed / WAITERS;
                    let ok = if m.attempts <= m.allowed {
                        "✓"
                    } else {
                        "✗"
                    };
                    let load = match (m.commands, row.n >= 9) {
                        (None, _) => "?".to_owned(),
                        (Some(n), true) => format!("{n} transactions"),
                        (Some(n), false) => format!("{n} commands"),
                    };
                    let most = m.log.causes.first().map_or(0, |c| c.1);
                    let errors = m.statuses.get(&500).copied().unwrap_or(0);
                    format!(
                        "{first} | {per_waiter:.2} (≤ {allowed}) {ok} | {load} | {} ({most}) | {errors} | {}",
                        m.log.lines, m.most_inside
                    )
                }
                Outcome::Skipped(why) => format!("{why} | | | | |"),
                Outcome::Failed(why) => {
                    let why = why.lines().next().unwrap_or_default().replace('|', "/");
                    format!("failed: {why} | | | | |")
                }
            };
            out.push_str(&format!("| {} | {} | {cells} |\n", row.n, row.fault));
        }
        out
    }
}
