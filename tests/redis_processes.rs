//! Fault tests that need separate processes: a lock (or permit) holder that is SIGKILLed
//! or SIGSTOPped; three `hammer` processes contending on one counter — on one server,
//! on a RedLock of five servers two of which are killed mid-run, and for permits
//! (recording how many holders are inside at once); a `hammer` whose RedLock loses its
//! quorum; and two `seckill` servers sharing one Redis.
//!
//! This test target has no libtest harness (`harness = false`): its `main` runs the
//! scenarios, and the same binary started with `--holder` is the lock-holding child, so
//! no test-only binary ships with the crate. Arguments other than `--holder ...` filter
//! scenarios by name, as libtest's do.

#[cfg(all(feature = "redis", feature = "axum"))]
#[path = "it/common/mod.rs"]
mod common;

#[cfg(all(feature = "redis", feature = "axum"))]
#[path = "../examples/seckill/app.rs"]
mod app;
#[cfg(all(feature = "redis", feature = "axum"))]
#[path = "../examples/seckill/redis_store.rs"]
mod redis_store;

#[cfg(all(feature = "redis", feature = "axum"))]
fn main() -> std::process::ExitCode {
    imp::main()
}

#[cfg(not(all(feature = "redis", feature = "axum")))]
fn main() {}

#[cfg(all(feature = "redis", feature = "axum"))]
mod imp {
    use std::future::Future;
    use std::pin::Pin;
    use std::process::{Child, Command, ExitCode, Stdio};
    use std::time::Duration;

    use super::common::redis_server::RedisServer;
    use super::common::seckill::{Seckill, forward_lines};
    use super::common::{example_binary, wait_until};
    use tokio::time::Instant;
    use tower_lock::{Error, Lease, LockClient, LockKey, RedisBackend};

    type Scenario = fn() -> Pin<Box<dyn Future<Output = ()> + Send>>;

    pub(crate) fn main() -> ExitCode {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if args.first().map(String::as_str) == Some("--holder") {
            return holder_main(&args[1..]);
        }
        let scenarios: [(&str, Scenario); 11] = [
            ("holder_sigkill_frees_lock_within_lease", || {
                Box::pin(holder_sigkill_frees_lock_within_lease())
            }),
            ("holder_sigstop_past_lease_is_taken_over_and_told", || {
                Box::pin(holder_sigstop_past_lease_is_taken_over_and_told())
            }),
            ("three_hammer_processes_keep_the_counter_exact", || {
                Box::pin(three_hammer_processes_keep_the_counter_exact())
            }),
            ("two_seckill_servers_share_one_redis", || {
                Box::pin(two_seckill_servers_share_one_redis())
            }),
            ("fair_and_write_hammers_keep_the_counter_exact", || {
                Box::pin(fair_and_write_hammers_keep_the_counter_exact())
            }),
            ("hammer_gives_up_after_wait_ms_and_leaves_the_queue", || {
                Box::pin(hammer_gives_up_after_wait_ms_and_leaves_the_queue())
            }),
            (
                "redlock_two_nodes_killed_mid_run_three_hammers_stay_exact",
                || Box::pin(redlock_two_nodes_killed_mid_run_three_hammers_stay_exact()),
            ),
            (
                "redlock_hammers_start_with_two_nodes_down_and_stay_exact",
                || Box::pin(redlock_hammers_start_with_two_nodes_down_and_stay_exact()),
            ),
            (
                "redlock_three_nodes_killed_hammer_fails_with_no_quorum_within_its_wait",
                || {
                    Box::pin(
                        redlock_three_nodes_killed_hammer_fails_with_no_quorum_within_its_wait(),
                    )
                },
            ),
            (
                "permits_never_exceed_n_holders_across_three_processes",
                || Box::pin(permits_never_exceed_n_holders_across_three_processes()),
            ),
            (
                "sigkilled_permit_holder_returns_its_permit_after_its_lease",
                || Box::pin(sigkilled_permit_holder_returns_its_permit_after_its_lease()),
            ),
        ];
        if args.iter().any(|a| a == "--list") {
            for (name, _) in &scenarios {
                println!("{name}: test");
            }
            return ExitCode::SUCCESS;
        }
        let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let mut failed = Vec::new();
        let mut ran = 0;
        for (name, scenario) in scenarios {
            if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
                continue;
            }
            ran += 1;
            let started = std::time::Instant::now();
            let outcome = runtime.block_on(async { tokio::spawn(scenario()).await });
            match outcome {
                Ok(()) => println!("test {name} ... ok ({:.2?})", started.elapsed()),
                Err(e) => {
                    println!("test {name} ... FAILED: {e}");
                    failed.push(name);
                }
            }
        }
        println!(
            "\ntest result: {}. {} passed; {} failed",
            if failed.is_empty() { "ok" } else { "FAILED" },
            ran - failed.len(),
            failed.len()
        );
        if failed.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    /// The child: takes the lock (watchdog with the given lease; `permits:N`: one of N
    /// permits), reports `LOCKED <token> <holder>`, waits until the lost signal fires,
    /// reports `LOST`, unlocks and reports the result.
    fn holder_main(args: &[String]) -> ExitCode {
        let (url, name, watchdog_ms, kind) = match args {
            [url, name, watchdog_ms] => (url, name, watchdog_ms, "lock"),
            [url, name, watchdog_ms, kind] => (url, name, watchdog_ms, kind.as_str()),
            _ => {
                eprintln!("usage: --holder URL NAME WATCHDOG_MS [lock|permits:N]");
                return ExitCode::from(2);
            }
        };
        let permits = match kind.strip_prefix("permits:").map(str::parse::<u32>) {
            None if kind == "lock" => None,
            Some(Ok(n)) => Some(n),
            _ => {
                eprintln!("KIND must be lock or permits:N");
                return ExitCode::from(2);
            }
        };
        let Ok(watchdog_ms) = watchdog_ms.parse::<u64>() else {
            eprintln!("WATCHDOG_MS must be a number");
            return ExitCode::from(2);
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        runtime.block_on(async {
            let backend = RedisBackend::connect(url.as_str()).await.expect("connect");
            let client = LockClient::builder(backend)
                .watchdog_lease(Duration::from_millis(watchdog_ms))
                .build()
                .expect("client");
            let lock = match permits {
                Some(n) => client.get_permits(name.as_str(), n),
                None => client.get_lock(name.as_str()),
            };
            let guard = lock.unwrap().fenced().lock().await.expect("lock");
            let token = guard.fencing_token().expect("a fenced lock has a token");
            println!("LOCKED {token} {}", guard.hold_id());
            guard.lost().wait().await;
            println!("LOST");
            match guard.unlock().await {
                Err(Error::Lost) => println!("UNLOCK lost"),
                Ok(()) => println!("UNLOCK ok"),
                Err(e) => println!("UNLOCK error {e}"),
            }
        });
        ExitCode::SUCCESS
    }

    struct Holder {
        child: Child,
        lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    }

    impl Holder {
        fn spawn(url: &str, name: &str, watchdog_ms: u64) -> Self {
            Self::spawn_kind(url, name, watchdog_ms, "lock")
        }

        fn spawn_kind(url: &str, name: &str, watchdog_ms: u64, kind: &str) -> Self {
            let exe = std::env::current_exe().expect("this test binary");
            let mut child = Command::new(exe)
                .args(["--holder", url, name, &watchdog_ms.to_string(), kind])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn the holder");
            let stdout = child.stdout.take().expect("piped stdout");
            Holder {
                child,
                lines: forward_lines(stdout),
            }
        }

        async fn expect_line(&mut self, prefix: &str, within: Duration) -> String {
            let line = tokio::time::timeout(within, self.lines.recv())
                .await
                .unwrap_or_else(|_| panic!("no {prefix:?} line from the holder within {within:?}"))
                .unwrap_or_else(|| panic!("the holder exited before printing {prefix:?}"));
            assert!(
                line.starts_with(prefix),
                "expected {prefix:?}, got {line:?}"
            );
            line
        }

        fn signal(&self, sig: &str) {
            let ok = Command::new("kill")
                .args([sig, &self.child.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig}");
        }
    }

    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    async fn holder_sigkill_frees_lock_within_lease() {
        let server = RedisServer::start().await;
        let lease = Duration::from_millis(1000);
        let mut holder = Holder::spawn(&server.url(), "killed", lease.as_millis() as u64);
        holder.expect_line("LOCKED", Duration::from_secs(10)).await;

        let backend = RedisBackend::connect(server.url()).await.unwrap();
        let client = LockClient::new(backend.clone());
        let lock = client.get_lock("killed").unwrap();
        let waiter = super::common::spawn_acquire(lock, Duration::from_secs(20));
        let key = LockKey::new("killed").unwrap();
        wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
            backend.local_waiters(&key) == 1
        })
        .await;
        // Kill right after a renewal has been seen, so the whole lease must run out.
        let mut raw = server.conn().await;
        let pttl = |mut raw: redis::aio::MultiplexedConnection| async move {
            let ttl: i64 = redis::cmd("PTTL")
                .arg("killed")
                .query_async(&mut raw)
                .await
                .unwrap();
            ttl
        };
        let mut previous = pttl(raw.clone()).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let ttl = pttl(raw.clone()).await;
            if ttl > previous {
                break;
            }
            previous = ttl;
            assert!(
                Instant::now() < deadline,
                "the holder's watchdog never renewed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = &mut raw;
        holder.signal("-KILL");
        let killed_at = Instant::now();
        let (acquired_at, guard) = waiter.await.unwrap().unwrap();
        let freed_after = acquired_at.duration_since(killed_at);
        assert!(
            freed_after <= lease + Duration::from_millis(100),
            "the lock was free {freed_after:?} after SIGKILL (lease {lease:?})"
        );
        guard.unlock().await.unwrap();
    }

    async fn holder_sigstop_past_lease_is_taken_over_and_told() {
        let server = RedisServer::start().await;
        let mut raw = server.conn().await;
        let lease = Duration::from_millis(600);
        let period = lease / 3;
        let mut holder = Holder::spawn(&server.url(), "stopped", lease.as_millis() as u64);
        let first: u64 = holder
            .expect_line("LOCKED", Duration::from_secs(10))
            .await
            .split(' ')
            .nth(1)
            .and_then(|t| t.parse().ok())
            .unwrap();

        holder.signal("-STOP");
        let client = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
        let started = Instant::now();
        let guard = client
            .get_fenced_lock("stopped")
            .unwrap()
            .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
            .await
            .expect("the stopped holder's lease runs out");
        assert!(
            started.elapsed() <= lease + Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
        assert!(
            guard.fencing_token().expect("fenced").get() > first,
            "fencing tokens are ordered"
        );

        holder.signal("-CONT");
        let resumed_at = Instant::now();
        holder.expect_line("LOST", Duration::from_secs(5)).await;
        let told_after = resumed_at.elapsed();
        assert!(
            told_after <= period + Duration::from_millis(300),
            "the resumed holder learned of the loss {told_after:?} after SIGCONT (period {period:?})"
        );
        holder
            .expect_line("UNLOCK lost", Duration::from_secs(5))
            .await;

        // The old holder's unlock left the new holder's lock alone.
        let fields: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg("stopped")
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(
            fields.get(guard.hold_id().as_str()).map(String::as_str),
            Some("1")
        );
        assert_eq!(fields.len(), 1);
        assert!(!guard.is_lost());
        guard.unlock().await.unwrap();
    }

    async fn three_hammer_processes_keep_the_counter_exact() {
        const ITERS: u64 = 300;
        let server = RedisServer::start().await;
        let hammer = example_binary("hammer");
        let mut children = Vec::new();
        for _ in 0..3 {
            // The interface from before `--kind` (no new flags): the reentrant lock.
            children.push(
                Command::new(&hammer)
                    .args([
                        "--url",
                        &server.url(),
                        "--name",
                        "hammer",
                        "--iters",
                        &ITERS.to_string(),
                    ])
                    .args(["--counter-key", "hammer:counter"])
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn hammer"),
            );
        }
        let outputs = tokio::task::spawn_blocking(move || {
            children
                .into_iter()
                .map(|c| c.wait_with_output().expect("hammer ran"))
                .collect::<Vec<_>>()
        })
        .await
        .unwrap();
        for out in &outputs {
            assert!(
                out.status.success(),
                "hammer failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut raw = server.conn().await;
        let counter: u64 = redis::cmd("GET")
            .arg("hammer:counter")
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(
            counter,
            3 * ITERS,
            "lost updates: the processes did not exclude each other"
        );
        let exists: i64 = redis::cmd("EXISTS")
            .arg("hammer")
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(exists, 0, "the lock was left behind");
    }

    /// Two `seckill` server processes on one Redis: the second joins the first one's
    /// sale instead of restocking it, and the demo burst split between them — each
    /// user's five concurrent orders, and the three sends of each, reaching both
    /// processes — keeps every invariant: the per-user lock, the stock and the replay
    /// of retried orders hold across processes.
    async fn two_seckill_servers_share_one_redis() {
        let server = RedisServer::start().await;
        let url = server.url();
        let env = [("REDIS_URL", url.as_str())];
        let first = Seckill::start(&env, &["--stock", "100"]).await;
        let second = Seckill::start(&env, &["--stock", "7"]).await;
        for process in [&first, &second] {
            assert!(
                process.said.iter().any(|l| l.starts_with("backend: redis")),
                "{:?}",
                process.said
            );
        }
        assert!(
            second.said.iter().any(|l| l.contains("already in Redis")),
            "the second server must join the sale: {:?}",
            second.said
        );

        let tally = super::app::burst(&[first.addr, second.addr], 1, Default::default())
            .await
            .unwrap();
        let store = super::redis_store::RedisStore::connect(&server.url())
            .await
            .unwrap();
        let runs = first.handler_runs().await + second.handler_runs().await;
        let verdict = super::app::verdict(&store, 1, 100, &tally, runs)
            .await
            .unwrap();
        assert!(verdict.held(), "{verdict:?}\n{}", super::app::table(&tally));
        assert_eq!((tally.keys, tally.replayed), (1500, 3000));
        assert_eq!(tally.other, 0, "{tally:?}");
        assert_eq!(
            (tally.created, tally.stock_left, tally.orders),
            (100, 0, 100)
        );
        wait_until(Duration::from_secs(10), "no lock key left", || async {
            server.keys("seckill:lock:*").await.is_empty()
        })
        .await;
        wait_until(Duration::from_secs(10), "no subscription left", || async {
            server.active_channels().await.is_empty()
        })
        .await;
    }

    /// The path of an example binary of this package, built (or found up to date) with
    /// this test's profile and features. `cargo test --all-targets` compiles examples
    /// only as test harnesses, so the plain binary it leaves may be stale: cargo decides.
    fn spawn_hammer(args: &[&str]) -> Child {
        Command::new(example_binary("hammer"))
            .args(args)
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn hammer")
    }

    /// Waits for the processes to exit, for at most `within` (then kills them and fails:
    /// a hammer that does not finish is an outcome too, not a hang of the suite).
    async fn outputs(mut children: Vec<Child>, within: Duration) -> Vec<std::process::Output> {
        let deadline = Instant::now() + within;
        loop {
            let mut running = 0;
            for c in &mut children {
                if c.try_wait().expect("poll the hammer").is_none() {
                    running += 1;
                }
            }
            if running == 0 {
                break;
            }
            if Instant::now() >= deadline {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                panic!("{running} hammer(s) still running after {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        children
            .into_iter()
            .map(|c| c.wait_with_output().expect("hammer ran"))
            .collect()
    }

    /// Waits for `children` (hammer processes) and asserts every one succeeded.
    async fn all_succeed(children: Vec<Child>) {
        for out in outputs(children, Duration::from_secs(120)).await {
            assert!(
                out.status.success(),
                "hammer failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// Asserts that no running node keeps `key`.
    async fn gone_from_every_live_node(nodes: &[RedisServer], key: &str) {
        for node in nodes.iter().filter(|n| n.is_running()) {
            let exists: i64 = redis::cmd("EXISTS")
                .arg(key)
                .query_async(&mut node.conn().await)
                .await
                .unwrap();
            assert_eq!(exists, 0, "the lock was left behind on a node");
        }
    }

    async fn get_u64(raw: &mut redis::aio::MultiplexedConnection, key: &str) -> u64 {
        let value: Option<u64> = redis::cmd("GET").arg(key).query_async(raw).await.unwrap();
        value.unwrap_or(0)
    }

    async fn five_servers() -> Vec<RedisServer> {
        let mut nodes = Vec::new();
        for _ in 0..5 {
            nodes.push(RedisServer::start().await);
        }
        nodes
    }

    fn urls(nodes: &[RedisServer]) -> String {
        nodes
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    async fn fair_and_write_hammers_keep_the_counter_exact() {
        const ITERS: u64 = 100;
        let server = RedisServer::start().await;
        let mut raw = server.conn().await;
        for kind in ["fair", "write"] {
            let counter_key = format!("{kind}:counter");
            let mut children = Vec::new();
            for _ in 0..3 {
                children.push(spawn_hammer(&[
                    "--kind",
                    kind,
                    "--url",
                    &server.url(),
                    "--name",
                    kind,
                    "--iters",
                    &ITERS.to_string(),
                    "--counter-key",
                    &counter_key,
                ]));
            }
            for out in outputs(children, Duration::from_secs(120)).await {
                assert!(
                    out.status.success(),
                    "{kind} hammer failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert_eq!(
                get_u64(&mut raw, &counter_key).await,
                3 * ITERS,
                "{kind}: lost updates: the processes did not exclude each other"
            );
        }
        let left: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut raw)
            .await
            .unwrap();
        let left: Vec<&String> = left
            .iter()
            .filter(|k| !k.ends_with(":counter") && !k.starts_with("redisson_lock_token:"))
            .collect();
        assert!(left.is_empty(), "lock state left behind: {left:?}");
    }

    async fn hammer_gives_up_after_wait_ms_and_leaves_the_queue() {
        let server = RedisServer::start().await;
        let mut raw = server.conn().await;
        let backend = RedisBackend::connect(server.url()).await.unwrap();
        let held = LockClient::new(backend.clone())
            .get_fair_lock("held")
            .unwrap()
            .lock()
            .await
            .unwrap();
        let wait = Duration::from_millis(400);
        let started = Instant::now();
        let child = spawn_hammer(&[
            "--kind",
            "fair",
            "--url",
            &server.url(),
            "--name",
            "held",
            "--iters",
            "1",
            "--counter-key",
            "held:counter",
            "--wait-ms",
            &wait.as_millis().to_string(),
        ]);
        let out = outputs(vec![child], Duration::from_secs(30))
            .await
            .remove(0);
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
        assert!(stderr.contains("lock is busy"), "stderr: {stderr}");
        assert!(took >= wait, "gave up after {took:?}, before its wait");
        assert!(
            took < wait + Duration::from_secs(5),
            "gave up only after {took:?}"
        );
        let queued: i64 = redis::cmd("LLEN")
            .arg(backend.queue_name(&LockKey::new("held").unwrap()))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(queued, 0, "the hammer that gave up is still queued");
        held.unlock().await.unwrap();
    }

    async fn redlock_two_nodes_killed_mid_run_three_hammers_stay_exact() {
        const ITERS: u64 = 60;
        let mut nodes = five_servers().await;
        let counter = RedisServer::start().await;
        let mut raw = counter.conn().await;
        let urls = urls(&nodes);
        let iters = ITERS.to_string();
        let mut children = Vec::new();
        for _ in 0..3 {
            children.push(spawn_hammer(&[
                "--kind",
                "redlock",
                "--url",
                &urls,
                "--counter-url",
                &counter.url(),
                "--name",
                "redlock",
                "--iters",
                &iters,
                "--counter-key",
                "redlock:counter",
                "--wait-ms",
                "30000",
            ]));
        }
        wait_until(Duration::from_secs(30), "the hammers are running", || {
            let mut raw = raw.clone();
            async move { get_u64(&mut raw, "redlock:counter").await >= ITERS / 2 }
        })
        .await;

        // Kill two of the five nodes while the three processes contend — at a moment
        // this process holds the lock, so that no hammer loses a node of its own hold
        // (its unlock could then not confirm a quorum, and it would stop with that
        // error): the hammers wait, and the two nodes killed are ones whose loss leaves
        // this hold on three live nodes.
        let mut backends = Vec::new();
        for node in &nodes {
            backends.push(
                RedisBackend::builder(node.url())
                    .reconnect_retries(0)
                    .build()
                    .await
                    .unwrap(),
            );
        }
        let redlock = tower_lock::kinds::RedLock::new(backends).unwrap();
        let guard = LockClient::new(redlock)
            .get_lock("redlock")
            .unwrap()
            .try_lock_for(Duration::from_secs(20), Lease::Watchdog)
            .await
            .expect("this process takes its turn");
        let mut holding = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let held: i64 = redis::cmd("HEXISTS")
                .arg("redlock")
                .arg(guard.hold_id().as_str())
                .query_async(&mut node.conn().await)
                .await
                .unwrap();
            holding.push((held == 1, i));
        }
        // Nodes without this hold first, then any: two to kill.
        holding.sort();
        let killed: Vec<usize> = holding.iter().take(2).map(|&(_, i)| i).collect();
        let done_before_kill = get_u64(&mut raw, "redlock:counter").await;
        for &i in &killed {
            nodes[i].kill();
        }
        guard
            .unlock()
            .await
            .expect("three live nodes still held this process's lock");

        all_succeed(children).await;
        assert!(
            done_before_kill < 3 * ITERS,
            "the nodes died only after the run ({done_before_kill} of {} done)",
            3 * ITERS
        );
        assert_eq!(
            get_u64(&mut raw, "redlock:counter").await,
            3 * ITERS,
            "lost updates: the processes did not exclude each other"
        );
        gone_from_every_live_node(&nodes, "redlock").await;
    }

    /// Two of five nodes are down before any process starts: three `hammer --kind
    /// redlock` processes start anyway (a node down is a failed vote, not a failed
    /// client) and keep the counter exact on the other three.
    async fn redlock_hammers_start_with_two_nodes_down_and_stay_exact() {
        const ITERS: u64 = 40;
        let mut nodes = five_servers().await;
        let counter = RedisServer::start().await;
        let mut raw = counter.conn().await;
        let urls = urls(&nodes);
        nodes[0].kill();
        nodes[4].kill();
        let iters = ITERS.to_string();
        let mut children = Vec::new();
        for _ in 0..3 {
            children.push(spawn_hammer(&[
                "--kind",
                "redlock",
                "--url",
                &urls,
                "--counter-url",
                &counter.url(),
                "--name",
                "down-at-start",
                "--iters",
                &iters,
                "--counter-key",
                "down-at-start:counter",
                "--wait-ms",
                "30000",
            ]));
        }
        all_succeed(children).await;
        assert_eq!(
            get_u64(&mut raw, "down-at-start:counter").await,
            3 * ITERS,
            "lost updates: the processes did not exclude each other"
        );
        gone_from_every_live_node(&nodes, "down-at-start").await;
    }

    async fn redlock_three_nodes_killed_hammer_fails_with_no_quorum_within_its_wait() {
        let mut nodes = five_servers().await;
        let counter = RedisServer::start().await;
        let raw = counter.conn().await;
        let wait = Duration::from_millis(1500);
        let child = spawn_hammer(&[
            "--kind",
            "redlock",
            "--url",
            &urls(&nodes),
            "--counter-url",
            &counter.url(),
            "--name",
            "quorum",
            "--iters",
            "1000000",
            "--counter-key",
            "quorum:counter",
            "--wait-ms",
            &wait.as_millis().to_string(),
        ]);
        wait_until(Duration::from_secs(30), "the hammer is running", || {
            let mut raw = raw.clone();
            async move { get_u64(&mut raw, "quorum:counter").await >= 10 }
        })
        .await;
        for node in &mut nodes[..3] {
            node.kill();
        }
        let killed_at = Instant::now();
        let out = outputs(vec![child], wait + Duration::from_secs(10))
            .await
            .remove(0);
        let took = killed_at.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
        assert!(
            stderr.contains("no quorum") && stderr.contains("5 nodes"),
            "not a quorum error: {stderr}"
        );
        assert!(
            took < wait + Duration::from_secs(2),
            "the hammer gave up {took:?} after the kill (wait {wait:?})"
        );
    }

    async fn permits_never_exceed_n_holders_across_three_processes() {
        const PERMITS: u64 = 3;
        const TASKS: u64 = 3;
        const ITERS: u64 = 40;
        let server = RedisServer::start().await;
        let mut raw = server.conn().await;
        let (tasks, iters, permits) = (TASKS.to_string(), ITERS.to_string(), PERMITS.to_string());
        let mut children = Vec::new();
        for _ in 0..3 {
            children.push(spawn_hammer(&[
                "--kind",
                "permits",
                "--permits",
                &permits,
                "--tasks",
                &tasks,
                "--url",
                &server.url(),
                "--name",
                "permits",
                "--iters",
                &iters,
                "--counter-key",
                "permits:counter",
            ]));
        }
        all_succeed(children).await;
        assert_eq!(
            get_u64(&mut raw, "permits:counter").await,
            3 * TASKS * ITERS
        );
        assert_eq!(get_u64(&mut raw, "permits:counter:inside").await, 0);
        let most = get_u64(&mut raw, "permits:counter:max").await;
        assert!(
            most <= PERMITS,
            "{most} holders at once across the processes, {PERMITS} permits"
        );
        assert!(
            most >= 2,
            "permits never overlapped: at most {most} at once"
        );
        let left: Vec<String> = redis::cmd("KEYS")
            .arg("*permits")
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!(left.is_empty(), "permit state left behind: {left:?}");
    }

    async fn sigkilled_permit_holder_returns_its_permit_after_its_lease() {
        let server = RedisServer::start().await;
        let mut raw = server.conn().await;
        let lease = Duration::from_millis(1000);
        let mut holder =
            Holder::spawn_kind(&server.url(), "pool", lease.as_millis() as u64, "permits:2");
        let line = holder.expect_line("LOCKED", Duration::from_secs(10)).await;
        let owner = line
            .split(' ')
            .nth(2)
            .expect("LOCKED <token> <holder>")
            .to_owned();

        // This process holds the other permit; a third owner waits for one.
        let backend = RedisBackend::connect(server.url()).await.unwrap();
        let client = LockClient::new(backend.clone());
        let mine = client.get_permits("pool", 2).unwrap().lock().await.unwrap();
        let lock = client.get_permits("pool", 2).unwrap();
        assert!(lock.try_lock().await.unwrap_err().is_busy());
        let waiter = super::common::spawn_acquire(lock, Duration::from_secs(20));
        let key = LockKey::new("pool").unwrap();
        wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
            backend.local_waiters(&key) == 1
        })
        .await;

        // Kill right after the holder's watchdog renewed its permit, so its whole lease
        // must run out: the permit's end of lease moved forward.
        let holders = backend.permits_name(&key);
        let score = |mut raw: redis::aio::MultiplexedConnection| {
            let (holders, owner) = (holders.clone(), owner.clone());
            async move {
                let at: Option<f64> = redis::cmd("ZSCORE")
                    .arg(&holders)
                    .arg(&owner)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                at.expect("the holder's permit is there")
            }
        };
        let mut previous = score(raw.clone()).await;
        let mut polled_at = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(5);
        let renewed_after = loop {
            let before = Instant::now();
            let at = score(raw.clone()).await;
            if at > previous {
                // The renewal happened after the previous poll.
                break polled_at;
            }
            previous = at;
            polled_at = before;
            assert!(
                Instant::now() < deadline,
                "the holder's watchdog never renewed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        holder.signal("-KILL");
        let killed_at = Instant::now();
        let (acquired_at, guard) = waiter.await.unwrap().unwrap();
        assert!(
            acquired_at >= renewed_after + lease,
            "the permit came back {:?} after the renewal, before its lease ({lease:?}) ended",
            acquired_at.duration_since(renewed_after)
        );
        assert!(
            acquired_at <= killed_at + lease + Duration::from_millis(200),
            "the permit came back {:?} after SIGKILL (lease {lease:?})",
            acquired_at.duration_since(killed_at)
        );
        // The other permit was never touched.
        let req = tower_lock::backend::LockRequest::new(
            key.clone(),
            mine.hold_id().clone(),
            mine.mode(),
            mine.lease(),
        );
        assert!(
            tower_lock::backend::LockBackend::renew(&backend, &req)
                .await
                .unwrap()
        );
        guard.unlock().await.unwrap();
        mine.unlock().await.unwrap();
        let _ = &mut raw;
    }
}
