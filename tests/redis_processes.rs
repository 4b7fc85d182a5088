//! Tests that need separate processes: a lock holder that is SIGKILLed or SIGSTOPped,
//! three `hammer` processes contending on one counter, and two `seckill` servers sharing
//! one Redis.
//!
//! This test target has no libtest harness (`harness = false`): its `main` runs the
//! scenarios, and the same binary started with `--holder` is the lock-holding child, so
//! no test-only binary ships with the crate. Arguments other than `--holder ...` filter
//! scenarios by name, as libtest's do.

#[cfg(all(feature = "redis", feature = "axum"))]
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
    use std::io::{BufRead, BufReader};
    use std::pin::Pin;
    use std::process::{Child, ChildStdout, Command, ExitCode, Stdio};
    use std::time::Duration;

    use super::common::redis_server::RedisServer;
    use super::common::wait_until;
    use tokio::time::Instant;
    use tower_lock::{Error, Lease, LockClient, LockKey, RedisBackend};

    type Scenario = fn() -> Pin<Box<dyn Future<Output = ()> + Send>>;

    pub(crate) fn main() -> ExitCode {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if args.first().map(String::as_str) == Some("--holder") {
            return holder_main(&args[1..]);
        }
        let scenarios: [(&str, Scenario); 4] = [
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

    /// The child: takes the lock (watchdog with the given lease), reports `LOCKED <token>`,
    /// waits until the lost signal fires, reports `LOST`, unlocks and reports the result.
    fn holder_main(args: &[String]) -> ExitCode {
        let [url, name, watchdog_ms] = args else {
            eprintln!("usage: --holder URL NAME WATCHDOG_MS");
            return ExitCode::from(2);
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
            let guard = client
                .get_lock(name.as_str())
                .unwrap()
                .lock()
                .await
                .expect("lock");
            println!("LOCKED {}", guard.fencing_token());
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
            let exe = std::env::current_exe().expect("this test binary");
            let mut child = Command::new(exe)
                .args(["--holder", url, name, &watchdog_ms.to_string()])
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

    fn forward_lines(stdout: ChildStdout) -> tokio::sync::mpsc::UnboundedReceiver<String> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        rx
    }

    async fn holder_sigkill_frees_lock_within_lease() {
        let server = RedisServer::start().await;
        let lease = Duration::from_millis(1000);
        let mut holder = Holder::spawn(&server.url(), "killed", lease.as_millis() as u64);
        holder.expect_line("LOCKED", Duration::from_secs(10)).await;

        let backend = RedisBackend::connect(server.url()).await.unwrap();
        let client = LockClient::new(backend.clone());
        let lock = client.get_lock("killed").unwrap();
        let waiter = tokio::spawn(async move {
            let guard = lock
                .try_lock_for(Duration::from_secs(20), Lease::Watchdog)
                .await?;
            Ok::<_, Error>((Instant::now(), guard))
        });
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
            .trim_start_matches("LOCKED ")
            .parse()
            .unwrap();

        holder.signal("-STOP");
        let client = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
        let started = Instant::now();
        let guard = client
            .get_lock("stopped")
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
            guard.fencing_token().get() > first,
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
            fields.get(guard.owner().as_str()).map(String::as_str),
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

    /// A `seckill` example server process on a free port, using Redis at `url`; killed
    /// on drop.
    struct Seckill {
        child: Child,
        addr: std::net::SocketAddr,
        /// What it printed before it started serving.
        said: Vec<String>,
        /// Kept so its stdout stays drained: a closed pipe would fail its next print.
        output: Option<tokio::sync::mpsc::UnboundedReceiver<String>>,
    }

    impl Seckill {
        async fn start(url: &str, args: &[&str]) -> Self {
            let mut child = Command::new(example_binary("seckill"))
                .env("REDIS_URL", url)
                .args(["--addr", "127.0.0.1:0"])
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn the seckill example");
            let stdout = child.stdout.take().expect("piped stdout");
            // Owned (and so killed on drop) before anything below can panic.
            let mut process = Seckill {
                child,
                addr: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
                said: Vec::new(),
                output: Some(forward_lines(stdout)),
            };
            let mut lines = process.output.take().expect("just set");
            loop {
                let said = &process.said;
                let line = tokio::time::timeout(Duration::from_secs(20), lines.recv())
                    .await
                    .unwrap_or_else(|_| panic!("seckill did not start serving: {said:?}"))
                    .unwrap_or_else(|| panic!("seckill exited before serving: {said:?}"));
                if let Some((_, addr)) = line.split_once(" on http://") {
                    process.addr = addr.parse().expect("the address seckill serves on");
                    process.output = Some(lines);
                    return process;
                }
                process.said.push(line);
            }
        }
    }

    impl Drop for Seckill {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Two `seckill` server processes on one Redis: the second joins the first one's
    /// sale instead of restocking it, and the demo burst split between them — each
    /// user's five concurrent clicks reaching both processes — keeps every invariant:
    /// the per-user lock and the stock hold across processes.
    async fn two_seckill_servers_share_one_redis() {
        let server = RedisServer::start().await;
        let first = Seckill::start(&server.url(), &["--stock", "100"]).await;
        let second = Seckill::start(&server.url(), &["--stock", "7"]).await;
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

        let tally = super::app::burst(&[first.addr, second.addr], 1, 300, 5, 250)
            .await
            .unwrap();
        let store = super::redis_store::RedisStore::connect(&server.url())
            .await
            .unwrap();
        let verdict = super::app::verdict(&store, 1, 100, &tally).await.unwrap();
        assert!(verdict.held(), "{verdict:?}\n{}", super::app::table(&tally));
        assert_eq!(tally.requests, 1500);
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
    fn example_binary(name: &str) -> std::path::PathBuf {
        let exe = std::env::current_exe().expect("this test binary");
        let profile_dir = exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("target/<profile>/deps/<test>");
        let features: Vec<&str> = [
            ("redis", cfg!(feature = "redis")),
            ("cluster", cfg!(feature = "cluster")),
            ("tls", cfg!(feature = "tls")),
            ("axum", cfg!(feature = "axum")),
        ]
        .into_iter()
        .filter_map(|(feature, on)| on.then_some(feature))
        .collect();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--quiet", "--example", name])
            .args(["--no-default-features", "--features", &features.join(",")]);
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        // Without the variables cargo set for this test run: build scripts that watch
        // them (ring watches CARGO_MANIFEST_DIR) would otherwise rebuild every time.
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            let set_for_tests = key.starts_with("CARGO_PKG_")
                || [
                    "CARGO_MANIFEST_DIR",
                    "CARGO_MANIFEST_PATH",
                    "CARGO_CRATE_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                    "CARGO_TARGET_TMPDIR",
                    "CARGO_BIN_NAME",
                ]
                .contains(&key.as_ref());
            if set_for_tests {
                build.env_remove(key.as_ref());
            }
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "building example {name}");
        let path = profile_dir.join("examples").join(name);
        assert!(path.exists(), "no example binary at {}", path.display());
        path
    }
}
