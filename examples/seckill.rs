//! A flash sale ("seckill") served through `LockLayer`: one order per user per voucher,
//! however many times the user clicks.
//!
//! ```sh
//! cargo run --example seckill                  # serve on 127.0.0.1:3000, voucher 1 with 100 in stock
//! cargo run --example seckill -- --demo        # fire 300 users × 5 identical requests, check the invariants
//! cargo run --example seckill -- --demo --no-lock   # the same without the lock: watch it break
//! ```
//!
//! Each order runs "has this user ordered? → take stock → insert the order". The check
//! and the insert are separate steps, so two concurrent requests of one user can both
//! pass the check and both order. `LockLayer` keyed by `lock:order:{<user id>}`
//! serializes each user's requests; different users never wait for each other.

#[path = "seckill/app.rs"]
mod app;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use app::{MemoryStore, Settings, Store};
use tower_lock::{LockClient, MemoryBackend};

const VOUCHER: u64 = 1;

const USAGE: &str = "usage: seckill [--addr HOST:PORT] [--stock N] [--wait-ms N] [--work-ms N] [--no-lock] \
[--demo [--users N] [--per-user N]]";

struct Args {
    addr: SocketAddr,
    stock: i64,
    demo: bool,
    users: u64,
    per_user: u64,
    settings: Settings,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
        stock: 100,
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

/// The lock client and the store. Everything else is the same whatever they are: this
/// is the one place to choose them (the Redis backend and a Redis store go here, picked
/// when `REDIS_URL` is set).
async fn backend_and_store(stock: i64) -> Result<(LockClient, Arc<dyn Store>), String> {
    if std::env::var_os("REDIS_URL").is_some() {
        eprintln!("note: REDIS_URL is set, but this build has no Redis store yet; using memory");
    }
    let client = LockClient::new(MemoryBackend::new());
    let store: Arc<dyn Store> = Arc::new(MemoryStore::with_voucher(VOUCHER, stock));
    Ok((client, store))
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
    let (client, store) = backend_and_store(args.stock).await?;
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
        println!(
            "seckill: voucher {VOUCHER} with {} in stock, on http://{addr}",
            args.stock
        );
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
    let tally = app::burst(addr, VOUCHER, args.users, args.per_user, 250).await?;
    let elapsed = started.elapsed();
    server.abort();
    println!("\n{}", app::table(&tally));
    println!("({} requests in {:.2?})\n", tally.requests, elapsed);
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
