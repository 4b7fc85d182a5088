//! A real `redis-server` per test, on a free loopback port, gone when the test ends.
//!
//! `RedisServer::start()` finds `redis-server` on `PATH`, starts it with no persistence in
//! a private temporary directory, and waits until it answers `PING`. Dropping the value
//! kills the process and removes the directory; a parent-death signal kills it too if the
//! test process dies without unwinding. Servers can be stopped, restarted on the same
//! port, and paused with SIGSTOP / resumed with SIGCONT, for fault tests.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

impl RedisServer {
    /// A fresh server with default settings.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A fresh server with extra `redis-server` arguments (e.g. `["--requirepass", "x"]`).
    pub async fn start_with(extra: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-redis-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let mut server = RedisServer {
            child: None,
            port: 0,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        for _attempt in 0..10 {
            // A port can be taken between our probe and the server's bind: then try another.
            server.port = free_port();
            if server.spawn_and_wait().await {
                return server;
            }
        }
        panic!("could not start redis-server (is it installed? .ci/run installs it)");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        match self.password() {
            Some(password) => format!("redis://:{password}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    fn password(&self) -> Option<&str> {
        let at = self.extra.iter().position(|a| a == "--requirepass")?;
        self.extra.get(at + 1).map(String::as_str)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    /// A raw connection for test assertions (plays other clients, reads keys).
    pub async fn conn(&self) -> MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test server")
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty.
    pub async fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.spawn_and_wait().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("could not restart redis-server on port {}", self.port);
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        signal(self.pid(), "-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        signal(self.pid(), "-CONT");
    }

    /// Spawns on `self.port`; true once it answers PING, false if it exited (port taken).
    async fn spawn_and_wait(&mut self) -> bool {
        let port = self.port.to_string();
        let dir = self.dir.to_string_lossy().into_owned();
        let log = self.dir.join("redis.log").to_string_lossy().into_owned();
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--dir", &dir, "--logfile", &log, "--daemonize", "no"])
        .args(&self.extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // If this test process dies without unwinding, take the server with it.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("redis-server on PATH");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        let url = self.url();
        loop {
            if let Some(_exited) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return false;
            }
            if ping(&url).await {
                return true;
            }
            if Instant::now() >= deadline {
                self.kill();
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn ping(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let connecting = tokio::time::timeout(
        Duration::from_millis(500),
        client.get_multiplexed_async_connection(),
    );
    let Ok(Ok(mut conn)) = connecting.await else {
        return false;
    };
    let pong: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
    pong.is_ok()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid} failed");
}
