//! A flash sale ("seckill") served through `LockLayer`: one order per user per voucher,
//! however many times the user clicks.
//!
//! ```sh
//! cargo run --example seckill                  # serve on 127.0.0.1:3000, voucher 1 with 100 in stock
//! cargo run --example seckill -- --demo        # fire 300 users × 5 identical requests, check the invariants
//! cargo run --example seckill -- --demo --no-lock   # the same without the lock: watch it break
//!
//! # Locks and data in Redis, shared by every process that uses it:
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example seckill -- --demo
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example seckill -- --addr 127.0.0.1:3000
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example seckill -- --addr 127.0.0.1:3001
//! ```
//!
//! Each order runs "has this user ordered? → take stock → insert the order". The check
//! and the insert are separate steps, so two concurrent requests of one user can both
//! pass the check and both order. `LockLayer` keyed by `lock:order:{<user id>}`
//! serializes each user's requests; different users never wait for each other.
//!
//! Without `REDIS_URL` the locks and the store live in this process. With it, the locks
//! are `RedisBackend` locks and vouchers and orders are in Redis (see
//! `seckill/redis_store.rs`; every key starts with `seckill:`), so several server
//! processes on different `--addr`s serve one sale, and a user's requests exclude each
//! other whichever process they reach. A server seeds voucher 1 with `--stock` only if
//! it is not in Redis yet (`SET NX`): the second process joins the first one's sale
//! instead of restocking it. `--reset` starts the sale afresh, and `--demo` always does.

#[path = "seckill/app.rs"]
mod app;
#[cfg(feature = "redis")]
#[path = "seckill/redis_store.rs"]
mod redis_store;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use app::{MemoryStore, Settings, Store};
use tower_lock::{LockClient, MemoryBackend};

const VOUCHER: u64 = 1;

const USAGE: &str = "usage: [REDIS_URL=redis://HOST:PORT] seckill [--addr HOST:PORT] [--stock N] [--reset] \
[--wait-ms N] [--work-ms N] [--no-lock] [--demo [--users N] [--per-user N]]";

struct Args {
    addr: SocketAddr,
    stock: i64,
    reset: bool,
    demo: bool,
    users: u64,
    per_user: u64,
    settings: Settings,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
        stock: 100,
        reset: false,
        demo: false,
        users: 300,
        per_user: 5,
        settings: Settings::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        fn num<T: std::str::FromStr>(name: &str, v: String) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{name}: not a valid number: {v:?}"))
        }
        match flag.as_str() {
            "--addr" => {
                let v = value("--addr")?;
                args.addr = v
                    .parse()
                    .map_err(|_| format!("--addr: not HOST:PORT: {v:?}"))?;
            }
            "--stock" => args.stock = num("--stock", value("--stock")?)?,
            "--users" => args.users = num("--users", value("--users")?)?,
            "--per-user" => args.per_user = num("--per-user", value("--per-user")?)?,
            "--wait-ms" => {
                args.settings.wait = Duration::from_millis(num("--wait-ms", value("--wait-ms")?)?)
            }
            "--work-ms" => {
                args.settings.work = Duration::from_millis(num("--work-ms", value("--work-ms")?)?)
            }
            "--no-lock" => args.settings.no_lock = true,
            "--reset" => args.reset = true,
            "--demo" => args.demo = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    if args.stock < 0 {
        return Err("--stock must not be negative".into());
    }
    if args.per_user == 0 || args.per_user > 1000 {
        return Err("--per-user must be between 1 and 1000".into());
    }
    Ok(args)
}

/// The lock client and the store, with voucher 1 in it. Everything else is the same
/// whatever they are: this is the one place to choose them.
async fn backend_and_store(args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => on_redis(&url, args).await,
        Err(std::env::VarError::NotUnicode(_)) => Err("REDIS_URL is not valid UTF-8".into()),
        _ => {
            println!(
                "backend: memory (locks and orders in this process; set REDIS_URL to share them)"
            );
            let client = LockClient::new(MemoryBackend::new());
            let store: Arc<dyn Store> = Arc::new(MemoryStore::with_voucher(VOUCHER, args.stock));
            Ok((client, store))
        }
    }
}

/// `RedisBackend` for the locks and `RedisStore` for the data, on the server at `url`.
#[cfg(feature = "redis")]
async fn on_redis(url: &str, args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    use redis::IntoConnectionInfo;
    use redis_store::{NAMESPACE, RedisStore, Seeded};
    use tower_lock::RedisBackend;

    // Where, without the password the URL may carry.
    let server = url
        .into_connection_info()
        .map_err(|e| format!("REDIS_URL is not a Redis URL: {e}"))?
        .addr()
        .to_string();
    let backend = RedisBackend::builder(url)
        .key_prefix(NAMESPACE)
        .build()
        .await
        .map_err(|e| format!("cannot reach Redis at {server} for the locks: {e}"))?;
    let store = RedisStore::connect(url)
        .await
        .map_err(|e| format!("cannot reach Redis at {server} for the store: {}", e.0))?;
    println!(
        "backend: redis at {server} (locks and orders shared by every process using it; \
         keys {NAMESPACE}*, fencing counters tower_lock_fence:{NAMESPACE}*)"
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
    Ok((LockClient::new(backend), Arc::new(store)))
}

#[cfg(not(feature = "redis"))]
async fn on_redis(_url: &str, _args: &Args) -> Result<(LockClient, Arc<dyn Store>), String> {
    Err("REDIS_URL is set, but this build has no Redis support (enable the `redis` feature)".into())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("seckill: {message}");
            }
            eprintln!("{USAGE}");
            return if message.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            };
        }
    };
    match run(args).await {
        Ok(code) => code,
        Err(message) => {
            eprintln!("seckill: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let (client, store) = backend_and_store(&args).await?;
    let app = app::app(client, store.clone(), args.settings).map_err(|e| e.to_string())?;
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
            "  curl -i http://{addr}/vouchers/{VOUCHER}                                   # stock and orders"
        );
        println!(
            "  curl -i -X POST http://{addr}/vouchers/{VOUCHER}/orders                    # 400: no x-user-id"
        );
        println!("  curl -i http://{addr}/vouchers/2                                       # 404");
        println!("stop with Ctrl-C");
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .map_err(|e| format!("server failed: {e}"))?;
        return Ok(ExitCode::SUCCESS);
    }

    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    println!(
        "seckill demo: {} users × {} concurrent identical orders against {} in stock on http://{addr} ({}; lock wait {:?}, handler work {:?})",
        args.users,
        args.per_user,
        args.stock,
        if args.settings.no_lock {
            "NO LOCK"
        } else {
            "LockLayer on lock:order:{user}"
        },
        args.settings.wait,
        args.settings.work,
    );
    let started = tokio::time::Instant::now();
    let tally = app::burst(&[addr], VOUCHER, args.users, args.per_user, 250).await?;
    let elapsed = started.elapsed();
    server.abort();
    println!("\n{}", app::table(&tally));
    println!("({} requests in {:.2?})\n", tally.requests, elapsed);
    if let Some(what) = &tally.first_other {
        println!("first unexpected answer: {what}\n");
    }
    let verdict = app::verdict(store.as_ref(), VOUCHER, args.stock, &tally)
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
