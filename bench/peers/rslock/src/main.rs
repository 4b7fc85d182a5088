//! rslock 0.10 on tower-lock's `w1`: each worker locks its own key (30 s TTL, as the
//! crate's bench), lock + unlock in a loop; one JSON line as `examples/bench` prints.
//!
//! `cargo run --release -- --url redis://127.0.0.1:6390 --workers 32 --seconds 5`

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rslock::LockManager;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = arg(&args, "--url", "redis://127.0.0.1:6379");
    let workers: usize = arg(&args, "--workers", "1").parse()?;
    let seconds: f64 = arg(&args, "--seconds", "5").parse()?;
    let manager = LockManager::new(vec![url]);
    // The connection is made on first use: not inside the measurement.
    let warm = manager.lock("rslock:warm", Duration::from_secs(30)).await?;
    manager.unlock(&warm).await;

    let started = Instant::now();
    let end = started + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for w in 0..workers {
        let manager = manager.clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("bench:rslock:{w}");
            let mut samples = Histogram::<u64>::new(3).expect("3 significant digits");
            let mut failures = 0u64;
            while Instant::now() < end {
                let t0 = Instant::now();
                match manager.lock(key.as_str(), Duration::from_secs(30)).await {
                    Ok(lock) => manager.unlock(&lock).await,
                    Err(_) => {
                        failures += 1;
                        continue;
                    }
                }
                samples.saturating_record(t0.elapsed().as_micros() as u64);
            }
            (samples, failures)
        }));
    }
    let mut samples = Histogram::<u64>::new(3)?;
    let mut failures = 0;
    for task in tasks {
        let (s, f) = task.await?;
        samples.add(s)?;
        failures += f;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let line = serde_json::json!({
        "peer": "rslock",
        "lang": "rust",
        "workload": "w1",
        "workers": workers,
        "elapsed_s": (elapsed * 1000.0).round() / 1000.0,
        "cycles": samples.len(),
        "cycles_per_s": (samples.len() as f64 / elapsed).round(),
        "cycle_p50_us": samples.value_at_quantile(0.5),
        "cycle_p99_us": samples.value_at_quantile(0.99),
        "lock_failures": failures,
        "backend": "redis",
        "version": "0.10.0",
    });
    println!("{line}");
    Ok(())
}
