//! The `seckill` example as a server process of its own, for the tests that need real
//! processes on one store: started on free ports, its admin listener's `/metrics` read
//! over HTTP, SIGKILLed by the test or killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;

use super::example_binary;

/// A `seckill` server process; killed on drop.
pub struct Seckill {
    child: Child,
    /// Where it serves the sale.
    pub addr: SocketAddr,
    /// Where its admin listener (`/metrics`, `/admin/...`) is.
    pub admin: SocketAddr,
    /// What it printed before it started serving.
    pub said: Vec<String>,
    /// Kept so its stdout stays drained: a closed pipe would fail its next print.
    output: Option<UnboundedReceiver<String>>,
}

impl Seckill {
    /// Starts `seckill --addr 127.0.0.1:0 <args>` with `env` (`REDIS_URL`,
    /// `DATABASE_URL`: the store; neither is inherited from the test's environment) and
    /// waits until it serves.
    pub async fn start(env: &[(&str, &str)], args: &[&str]) -> Self {
        let mut command = Command::new(example_binary("seckill"));
        command.env_remove("REDIS_URL").env_remove("DATABASE_URL");
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command
            .args(["--addr", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the seckill example");
        let stdout = child.stdout.take().expect("piped stdout");
        // Owned (and so killed on drop) before anything below can panic.
        let unset = SocketAddr::from(([0, 0, 0, 0], 0));
        let mut process = Seckill {
            child,
            addr: unset,
            admin: unset,
            said: Vec::new(),
            output: Some(forward_lines(stdout)),
        };
        let mut lines = process.output.take().expect("just set");
        loop {
            let said = &process.said;
            let line = tokio::time::timeout(Duration::from_secs(30), lines.recv())
                .await
                .unwrap_or_else(|_| panic!("seckill did not start serving: {said:?}"))
                .unwrap_or_else(|| panic!("seckill exited before serving: {said:?}"));
            if let Some(rest) = line.strip_prefix("admin: http://") {
                let admin = rest.split('/').next().expect("admin: http://<addr>/...");
                process.admin = admin.parse().expect("the admin address");
            }
            if let Some((_, addr)) = line.split_once(" on http://") {
                process.addr = addr.parse().expect("the address seckill serves on");
                process.output = Some(lines);
                return process;
            }
            process.said.push(line);
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and waits (up to `within`) for the process to exit: whether it
    /// exited successfully, and every line it printed after it started serving.
    pub async fn terminate(mut self, within: Duration) -> (bool, Vec<String>) {
        let pid = i32::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill(2) on our own child, which has not been reaped yet.
        let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(sent, 0, "SIGTERM seckill");
        let mut lines = self.output.take().expect("its output");
        let mut said = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        while let Ok(Some(line)) = tokio::time::timeout_at(deadline, lines.recv()).await {
            said.push(line);
        }
        let started = tokio::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("seckill's status") {
                return (status.success(), said);
            }
            assert!(
                started.elapsed() < within,
                "seckill did not exit within {within:?} of SIGTERM: {said:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILLs the process and reaps it.
    pub fn kill(&mut self) {
        // `Child::kill` is SIGKILL.
        self.child.kill().expect("SIGKILL seckill");
        self.child.wait().expect("reap seckill");
    }

    /// The sum of the samples of `name` on its `/metrics` whose labels contain every
    /// one of `labels` (`outcome="replayed"`); 0 when there is none yet.
    pub async fn metric(&self, name: &str, labels: &[&str]) -> u64 {
        let (status, text) = http_get(self.admin, "/metrics").await;
        assert_eq!(status, 200, "/metrics: {text}");
        text.lines()
            .filter(|line| {
                line.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']))
                    && labels.iter().all(|label| line.contains(label))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// How many times its order handler ran.
    pub async fn handler_runs(&self) -> u64 {
        self.metric("seckill_order_handler_runs_total", &[]).await
    }
}

impl Drop for Seckill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lines a child writes on `stdout`, as they come.
pub fn forward_lines(stdout: ChildStdout) -> UnboundedReceiver<String> {
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

/// `GET path` over a fresh HTTP/1.1 connection to `addr`: the status and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).await.unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned());
    (status, body)
}
