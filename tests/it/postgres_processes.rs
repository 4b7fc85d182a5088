//! Separate processes on one PostgreSQL database: three `hammer` processes contending on
//! one lock keep a counter exact, and a `hammer` SIGKILLed while it holds the lock (in
//! the middle of its read-modify-write) leaves the lock to the others only when its
//! watchdog lease ends, without its unfinished increment. With hand-over, a `hammer`
//! SIGKILLed while it waits is never handed the lock.
//!
//! Each test has a database of its own (dropped afterwards) and kills every process it
//! starts. The hammers' counter is the row K of `hammer_counter`; every write also
//! appends `(value, pid, at)` to `hammer_counter_writes` in the same statement, so the
//! oracle is stronger than the final count: with exclusion, the values written are 1 to
//! N, each exactly once, and the database's clock says when the first write after a
//! kill happened.

use crate::common;

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::example_binary;
use common::postgres::PgDatabase;
use common::wait_until;
use sqlx::PgPool;
use tokio::time::Instant;

/// The tests start several processes each and one bounds a timing: they run one at a
/// time even when libtest runs tests in parallel.
pub(crate) static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hammer_processes_keep_a_postgres_counter_exact() {
    const ITERS: u64 = 300;
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = PgDatabase::create().await;
    let started = Instant::now();
    let iters = ITERS.to_string();
    let hammers: Vec<Hammer> = (0..3)
        .map(|_| {
            Hammer::spawn(&[
                "--url",
                &db.url,
                "--name",
                "pg-hammer",
                "--iters",
                &iters,
                "--counter-key",
                "pg:counter",
            ])
        })
        .collect();
    let pids: Vec<u32> = hammers.iter().map(Hammer::id).collect();
    succeeded(hammers, Duration::from_secs(120)).await;
    let took = started.elapsed();

    let pool = db.pool(2).await;
    let counter = counter(&pool, "pg:counter").await;
    let writes = writes(&pool, "pg:counter").await;
    println!(
        "three hammers, {ITERS} iterations each: counter {counter}, {} writes, {took:.2?}",
        writes.count
    );
    assert_eq!(
        counter,
        3 * ITERS as i64,
        "lost updates: the processes did not exclude each other"
    );
    writes.assert_each_value_once(3 * ITERS);
    for pid in pids {
        assert_eq!(
            writes.by(pid),
            ITERS as i64,
            "process {pid} did not do all its increments"
        );
    }
    assert_eq!(
        holds(&pool, "pg-hammer").await,
        0,
        "the lock was left behind"
    );
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_holder_frees_the_lock_after_its_lease_and_the_count_stays_exact() {
    const ITERS: u64 = 150;
    let lease = Duration::from_millis(1000);
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = PgDatabase::create().await;
    let pool = db.pool(2).await;
    let watchdog = lease.as_millis().to_string();
    let url_as = |app: &str| format!("{}?application_name={app}", db.url);

    // The victim takes the lock, reads the counter and sits on it (ten minutes between
    // its read and its write), its watchdog renewing a 1 s lease.
    let mut victim = Hammer::spawn(&[
        "--url",
        &url_as("hammer-victim"),
        "--name",
        "pg-killed",
        "--iters",
        "1",
        "--counter-key",
        "pg:killed",
        "--watchdog-ms",
        &watchdog,
        "--hold-us",
        "600000000",
    ]);
    wait_until(
        Duration::from_secs(20),
        "the victim holds the lock and has read the counter",
        || async {
            holds(&pool, "pg-killed").await == 1
                && activity(&pool, "hammer-victim", "SELECT value FROM hammer_counter%").await == 1
        },
    )
    .await;
    let (victim_owner, _) = hold(&pool, "pg-killed").await.expect("the victim's hold");

    // Two more processes wait for the lock.
    let iters = ITERS.to_string();
    let others: Vec<Hammer> = (0..2)
        .map(|_| {
            Hammer::spawn(&[
                "--url",
                &url_as("hammer-other"),
                "--name",
                "pg-killed",
                "--iters",
                &iters,
                "--counter-key",
                "pg:killed",
                "--watchdog-ms",
                &watchdog,
            ])
        })
        .collect();
    let other_pids: Vec<u32> = others.iter().map(Hammer::id).collect();
    wait_until(
        Duration::from_secs(20),
        "the other two listen for releases",
        || async {
            activity(&pool, "hammer-other", "LISTEN%").await
                + activity(&pool, "hammer-other", "/* tower-lock listener */%").await
                == 2
        },
    )
    .await;

    // Kill right after a renewal has been seen, so the whole lease must run out.
    let (_, mut previous) = hold(&pool, "pg-killed").await.expect("still held");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, at) = hold(&pool, "pg-killed").await.expect("still held");
        if at > previous {
            break;
        }
        previous = at;
        assert!(
            Instant::now() < deadline,
            "the victim's watchdog never renewed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    victim.kill();
    let killed_at = db_clock_us(&pool).await;
    // A renewal sent just before the kill still commits: read the end of the lease once
    // the server has closed the victim's connections.
    wait_until(
        Duration::from_secs(5),
        "the victim's connections are gone",
        || async { activity(&pool, "hammer-victim", "%").await == 0 },
    )
    .await;
    let (owner, lease_end) = hold(&pool, "pg-killed")
        .await
        .expect("the victim's hold is still there before its lease ends");
    assert_eq!(owner, victim_owner);
    assert_eq!(
        victim.child.wait().expect("reap the victim").signal(),
        Some(libc::SIGKILL)
    );

    succeeded(others, Duration::from_secs(120)).await;
    let lease_left = Duration::from_micros((lease_end - killed_at).max(0).unsigned_abs());
    assert!(
        lease_left <= lease,
        "{lease_left:?} of a {lease:?} lease left"
    );
    let writes = the_kill_cost_nothing(
        &pool,
        "pg:killed",
        lease_end,
        (victim.id(), &other_pids),
        ITERS,
    )
    .await;
    println!(
        "SIGKILL with {lease_left:?} of the lease left; first write {:.1} ms after the kill",
        (writes.first_at_us - killed_at) as f64 / 1000.0
    );
    assert_eq!(
        holds(&pool, "pg-killed").await,
        0,
        "the lock was left behind"
    );
    pool.close().await;
}

/// Issue 23, hand-over: a process SIGKILLed while it waits leaves its registration
/// behind (until what blocked it ends), and must never be handed the lock — nobody
/// would release it before its lease ended. Its listening session's advisory lock ended
/// with the process, and the release hands the lock to the live waiter behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_process_sigkilled_is_never_handed_the_lock() {
    use tower_lock::backend::{Acquire, LockBackend, LockMode, LockRequest, Release, Wake};
    use tower_lock::{HoldId, LockKey};

    let _serial = ONE_AT_A_TIME.lock().await;
    let db = PgDatabase::create().await;
    let pool = db.pool(2).await;
    let holder = handing(&db).await;
    let request = |owner: &str| {
        LockRequest::new(
            LockKey::new("pg-orphan").unwrap(),
            HoldId::from_raw(owner).unwrap(),
            LockMode::Exclusive,
            Duration::from_secs(30),
        )
    };
    let held = request("holder:1");
    assert!(matches!(
        holder.acquire(&held).await.unwrap(),
        Acquire::Acquired(_)
    ));

    // A hammer waits for the lock (registered first), then a waiter of this process.
    let mut victim = Hammer::spawn(&[
        "--url",
        &format!("{}?application_name=hammer-waiter", db.url),
        "--name",
        "pg-orphan",
        "--iters",
        "1",
        "--counter-key",
        "pg:orphan",
        "--hand-over",
    ]);
    wait_until(
        Duration::from_secs(20),
        "the hammer is registered as a waiter",
        || async { waiters(&pool, "pg-orphan").await.len() == 1 },
    )
    .await;
    let waiter = handing(&db).await;
    let alive = request("alive:1");
    let mut sub = waiter.subscribe(&alive).await.unwrap();
    assert!(matches!(
        waiter.acquire(&alive).await.unwrap(),
        Acquire::Busy { .. }
    ));
    let registered = waiters(&pool, "pg-orphan").await;
    assert_eq!(registered.len(), 2);
    assert_eq!(registered[1], "alive:1", "the hammer first: {registered:?}");

    victim.kill();
    wait_until(
        Duration::from_secs(5),
        "the hammer's sessions are gone",
        || async { activity(&pool, "hammer-waiter", "%").await == 0 },
    )
    .await;
    assert_eq!(
        victim.child.wait().expect("reap the hammer").signal(),
        Some(libc::SIGKILL)
    );
    assert_eq!(holder.release(&held).await.unwrap(), Release::Released);
    let (owner, _) = hold(&pool, "pg-orphan").await.expect("handed to a waiter");
    assert_eq!(owner, "alive:1", "handed past the killed process's waiter");
    assert!(
        waiters(&pool, "pg-orphan").await.is_empty(),
        "the dead registration went with the hand-over"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    assert_eq!(sub.wait(deadline).await, Wake::Notified);
    assert!(matches!(
        waiter.acquire(&alive).await.unwrap(),
        Acquire::Acquired(_)
    ));
    drop(sub);
    assert_eq!(waiter.release(&alive).await.unwrap(), Release::Released);
    drop((holder, waiter));
    pool.close().await;
}

/// A backend on a pool of its own whose exclusive waiters are handed released locks.
async fn handing(db: &PgDatabase) -> tower_lock::PostgresBackend {
    tower_lock::PostgresBackend::builder(db.pool(4).await)
        .hand_over(true)
        .build()
        .await
        .unwrap()
}

/// The registered exclusive waiters of `name`, oldest first.
async fn waiters(pool: &PgPool, name: &str) -> Vec<String> {
    let table: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('tower_lock_waiters')::text")
            .fetch_one(pool)
            .await
            .unwrap();
    if table.is_none() {
        return Vec::new();
    }
    sqlx::query_scalar("SELECT owner FROM tower_lock_waiters WHERE name = $1 ORDER BY since")
        .bind(name)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A `hammer` process; killed on drop.
pub(crate) struct Hammer {
    pub(crate) child: Child,
}

impl Hammer {
    pub(crate) fn spawn(args: &[&str]) -> Self {
        let child = Command::new(example_binary("hammer"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn hammer");
        Hammer { child }
    }

    pub(crate) fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status and what it wrote on stderr, once it has exited.
    fn output(mut self) -> Output {
        let mut stderr = Vec::new();
        if let Some(mut pipe) = self.child.stderr.take() {
            use std::io::Read;
            let _ = pipe.read_to_end(&mut stderr);
        }
        let status = self.child.wait().expect("the hammer ran");
        Output {
            status,
            stdout: Vec::new(),
            stderr,
        }
    }

    pub(crate) fn kill(&mut self) {
        // `Child::kill` is SIGKILL.
        self.child.kill().expect("SIGKILL the hammer");
    }
}

impl Drop for Hammer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for the processes to exit, for at most `within` (then kills them and fails: a
/// hammer that does not finish is an outcome too, not a hang of the suite).
pub(crate) async fn outputs(mut hammers: Vec<Hammer>, within: Duration) -> Vec<Output> {
    let deadline = Instant::now() + within;
    loop {
        let mut running = 0;
        for h in &mut hammers {
            if h.child.try_wait().expect("poll the hammer").is_none() {
                running += 1;
            }
        }
        if running == 0 {
            break;
        }
        // Dropping the hammers kills them.
        assert!(
            Instant::now() < deadline,
            "{running} hammer(s) still running after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    hammers.into_iter().map(Hammer::output).collect()
}

/// Waits for the processes to exit, as [`outputs`], and fails unless each succeeded.
pub(crate) async fn succeeded(hammers: Vec<Hammer>, within: Duration) {
    for out in outputs(hammers, within).await {
        assert!(
            out.status.success(),
            "hammer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// What a holder SIGKILLed mid read-modify-write must leave in the counter `key`, whose
/// lease ended at `lease_end_us` (the database's clock): no write before that end and
/// the first soon after it, every value written once, nothing by the `victim`, and
/// `iters` by each of the `others`. Returns the log of writes.
pub(crate) async fn the_kill_cost_nothing(
    pool: &PgPool,
    key: &str,
    lease_end_us: i64,
    (victim, others): (u32, &[u32]),
    iters: u64,
) -> Writes {
    let counter = counter(pool, key).await;
    let writes = writes(pool, key).await;
    kill_cost_nothing(counter, writes, lease_end_us, (victim, others), iters)
}

/// [`the_kill_cost_nothing`] on a counter and its log read from any store.
pub(crate) fn kill_cost_nothing(
    counter: i64,
    writes: Writes,
    lease_end_us: i64,
    (victim, others): (u32, &[u32]),
    iters: u64,
) -> Writes {
    let first_after_end = writes.first_at_us - lease_end_us;
    println!(
        "first write {:.1} ms after the killed holder's lease ended; counter {counter}, {} \
         writes",
        first_after_end as f64 / 1000.0,
        writes.count
    );
    // Nobody got in before the lease ended, and the waiters got in soon after.
    assert!(
        first_after_end >= 0,
        "a write {} µs before the killed holder's lease ended",
        -first_after_end
    );
    assert!(
        first_after_end <= 300_000,
        "the first write came {first_after_end} µs after the lease ended"
    );
    // Exact, and without the victim's unfinished increment: it read 0 and never wrote 1.
    let total = others.len() as u64 * iters;
    assert_eq!(
        counter, total as i64,
        "lost or extra updates around the kill"
    );
    writes.assert_each_value_once(total);
    assert_eq!(writes.by(victim), 0, "the killed process wrote");
    for &pid in others {
        assert_eq!(writes.by(pid), iters as i64, "process {pid}");
    }
    writes
}

/// The counter's value (0 when it was never written).
pub(crate) async fn counter(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar::<_, i64>("SELECT value FROM hammer_counter WHERE key = $1")
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
        .unwrap_or(0)
}

/// What `hammer_counter_writes` says about one counter.
pub(crate) struct Writes {
    pub(crate) count: i64,
    pub(crate) distinct: i64,
    pub(crate) min: i64,
    pub(crate) max: i64,
    /// The first write, by the database's clock, in microseconds since the epoch.
    pub(crate) first_at_us: i64,
    pub(crate) per_pid: Vec<(i32, i64)>,
}

impl Writes {
    /// Every value from 1 to `n` written exactly once: no two holders read the same
    /// value, and nobody wrote outside the sequence.
    pub(crate) fn assert_each_value_once(&self, n: u64) {
        let n = n as i64;
        assert_eq!(
            (self.count, self.distinct, self.min, self.max),
            (n, n, 1, n),
            "(writes, distinct values, min, max): the values written are not 1..={n} once each"
        );
    }

    /// The writes of process `pid`.
    pub(crate) fn by(&self, pid: u32) -> i64 {
        self.per_pid
            .iter()
            .find(|&&(p, _)| i64::from(p) == i64::from(pid))
            .map_or(0, |&(_, n)| n)
    }
}

pub(crate) async fn writes(pool: &PgPool, key: &str) -> Writes {
    let (count, distinct, min, max, first_at_us): (
        i64,
        i64,
        Option<i64>,
        Option<i64>,
        Option<i64>,
    ) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT value), min(value), max(value), \
                    (extract(epoch FROM min(at)) * 1000000)::bigint \
               FROM hammer_counter_writes WHERE key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap();
    let per_pid: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT pid, count(*) FROM hammer_counter_writes WHERE key = $1 GROUP BY pid",
    )
    .bind(key)
    .fetch_all(pool)
    .await
    .unwrap();
    Writes {
        count,
        distinct,
        min: min.unwrap_or(0),
        max: max.unwrap_or(0),
        first_at_us: first_at_us.expect("at least one write"),
        per_pid,
    }
}

/// Holds of `name` in the backend's table, expired or not (0 before the first hammer
/// has created the table).
async fn holds(pool: &PgPool, name: &str) -> i64 {
    let table: Option<String> = sqlx::query_scalar("SELECT to_regclass('tower_lock')::text")
        .fetch_one(pool)
        .await
        .unwrap();
    if table.is_none() {
        return 0;
    }
    // An exclusive hold is the owner of the name's row.
    sqlx::query_scalar(
        "SELECT count(*) FROM tower_lock_names WHERE name = $1 AND owner IS NOT NULL",
    )
    .bind(name)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The one hold of `name`: its owner and the end of its lease (the database's clock, in
/// microseconds since the epoch).
async fn hold(pool: &PgPool, name: &str) -> Option<(String, i64)> {
    sqlx::query_as(
        "SELECT owner, (extract(epoch FROM expires_at) * 1000000)::bigint \
           FROM tower_lock_names WHERE name = $1 AND owner IS NOT NULL",
    )
    .bind(name)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// The database's clock, in microseconds since the epoch.
pub(crate) async fn db_clock_us(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Connections of `app` (its `application_name`) whose last statement is like `query`
/// and that are idle, waiting for the next one.
pub(crate) async fn activity(pool: &PgPool, app: &str, query: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
          WHERE application_name = $1 AND query LIKE $2 \
            AND (state = 'idle' OR $2 = '%')",
    )
    .bind(app)
    .bind(query)
    .fetch_one(pool)
    .await
    .unwrap()
}
