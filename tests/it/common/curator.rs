//! Curator, the reference ZooKeeper lock client, as child processes: what tower-lock's
//! ZooKeeper backend must interoperate with, and the yardstick its wake-up delays are
//! measured against.
//!
//! `tests/curator/CuratorLock.java` is compiled with `javac` into Cargo's test scratch
//! directory (`CARGO_TARGET_TMPDIR`) the first time a test of this process needs it, and
//! again only when the source is newer than the class (a file lock keeps test processes
//! from compiling over each other). [`Curator`] spawns it against a connect string with
//! one of its commands (`hammer`, `hold`, `wait`; see the Java file), and
//! [`CuratorProcess`] reads its event lines with deadlines, tells it to release, and
//! kills it on drop. Its stdout carries only event lines (logging goes to slf4j-nop);
//! its stderr is kept for failure messages.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

use super::zookeeper::{JARS, pause_process, resume_process};

/// The client's jars: the Curator recipes and what they use, and slf4j-nop, which
/// silences ZooKeeper's and Curator's logging.
const CLIENT_JARS: &[&str] = &[
    "curator-recipes.jar",
    "curator-framework.jar",
    "curator-client.jar",
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "guava.jar",
    "slf4j-api.jar",
    "slf4j-nop.jar",
];

/// A client JVM: smaller still than a server's.
const CLIENT_JVM_FLAGS: &[&str] = &[
    "-Xms16m",
    "-Xmx128m",
    "-Xss512k",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-Djava.net.preferIPv4Stack=true",
];

fn jars() -> Vec<String> {
    CLIENT_JARS.iter().map(|j| format!("{JARS}/{j}")).collect()
}

/// The directory of the compiled `CuratorLock` classes, compiled once per test process
/// and only when the source changed.
pub fn classes() -> &'static Path {
    static CLASSES: OnceLock<PathBuf> = OnceLock::new();
    CLASSES.get_or_init(|| {
        let source =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/curator/CuratorLock.java");
        let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let out = scratch.join("curator-classes");
        std::fs::create_dir_all(&out).expect("the classes' directory");
        // Another test binary may be compiling the same file into the same directory.
        let lock = std::fs::File::create(scratch.join("curator-classes.lock"))
            .expect("the classes' lock file");
        // SAFETY: flock(2) on a descriptor this function owns until it returns; closing
        // it (dropping `lock`) releases the lock.
        let locked = unsafe {
            use std::os::fd::AsRawFd;
            libc::flock(lock.as_raw_fd(), libc::LOCK_EX)
        };
        assert_eq!(locked, 0, "flock the classes' lock file");
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let class = out.join("CuratorLock.class");
        let stale = match (modified(&class), modified(&source)) {
            (Some(class), Some(source)) => class < source,
            _ => true,
        };
        if stale {
            let compiled = Command::new("javac")
                // No /tmp/hsperfdata_<user> file for javac's JVM either.
                .args(["-J-XX:-UsePerfData", "-nowarn", "-d"])
                .arg(&out)
                .args(["-cp", &jars().join(":")])
                .arg(&source)
                .output()
                .expect("javac on PATH (.ci/run installs default-jdk-headless)");
            assert!(
                compiled.status.success(),
                "javac {} failed:\n{}{}",
                source.display(),
                String::from_utf8_lossy(&compiled.stdout),
                String::from_utf8_lossy(&compiled.stderr)
            );
        }
        drop(lock);
        out
    })
}

/// A lock recipe of Curator's, as `CuratorLock` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `InterProcessMutex` at the path.
    Mutex,
    /// `InterProcessReadWriteLock(path).writeLock()`.
    Write,
    /// `InterProcessReadWriteLock(path).readLock()`.
    Read,
    /// `InterProcessSemaphoreV2(path, max)` (`hold` and `wait` only).
    Semaphore(u32),
}

impl Mode {
    fn arg(self) -> String {
        match self {
            Mode::Mutex => "mutex".into(),
            Mode::Write => "write".into(),
            Mode::Read => "read".into(),
            Mode::Semaphore(max) => format!("semaphore:{max}"),
        }
    }
}

/// How to start `CuratorLock` processes: the ensemble and the session's settings.
#[derive(Clone, Debug)]
pub struct Curator {
    connect: String,
    session: Option<Duration>,
    connection: Option<Duration>,
}

impl Curator {
    /// Clients of the servers in `connect` (`host:port[,host:port...]`), with
    /// `CuratorLock`'s defaults: a 10 s session, a 5 s connection timeout.
    pub fn new(connect: impl Into<String>) -> Self {
        Curator {
            connect: connect.into(),
            session: None,
            connection: None,
        }
    }

    /// The session timeout the client asks for (the server bounds it to 0.4–60 s).
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session = Some(timeout);
        self
    }

    /// How long the client waits to connect (and Curator's connection timeout).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection = Some(timeout);
        self
    }

    /// `hammer`: `iterations` times take the lock, add one to the number in `counter`
    /// (`Mode::Read` only reads it), release; prints `acquired`/`released` for each and
    /// `done <iterations>` at the end.
    pub fn hammer(
        &self,
        path: &str,
        mode: Mode,
        iterations: u32,
        counter: &Path,
    ) -> CuratorProcess {
        assert!(
            !matches!(mode, Mode::Semaphore(_)),
            "hammer takes a mutex, write or read lock"
        );
        let counter = counter.to_string_lossy().into_owned();
        self.spawn(
            path,
            &["hammer", &mode.arg(), &iterations.to_string(), &counter],
        )
    }

    /// `hold`: takes the lock, prints `acquired`, holds it until
    /// [`CuratorProcess::release`], then prints `released` and exits.
    pub fn hold(&self, path: &str, mode: Mode) -> CuratorProcess {
        self.spawn(path, &["hold", &mode.arg()])
    }

    /// `wait`: blocks in acquire, prints `acquired` as soon as it returns, releases
    /// (`released`) and exits.
    pub fn wait(&self, path: &str, mode: Mode) -> CuratorProcess {
        self.spawn(path, &["wait", &mode.arg()])
    }

    fn spawn(&self, path: &str, command: &[&str]) -> CuratorProcess {
        let mut classpath = vec![classes().to_string_lossy().into_owned()];
        classpath.extend(jars());
        let mut cmd = Command::new("java");
        cmd.args(CLIENT_JVM_FLAGS)
            .args(["-cp", &classpath.join(":")])
            .arg("CuratorLock");
        if let Some(session) = self.session {
            cmd.args(["--session-ms", &session.as_millis().to_string()]);
        }
        if let Some(connection) = self.connection {
            cmd.args(["--connection-ms", &connection.as_millis().to_string()]);
        }
        cmd.arg(&self.connect)
            .arg(path)
            .args(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl(2) only, between fork and exec: if this test process dies without
        // unwinding, the client gets SIGKILL.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("java on PATH (.ci/run installs it)");
        let stdin = child.stdin.take();
        let lines = super::seckill::forward_lines(child.stdout.take().expect("piped stdout"));
        let stderr = Arc::new(Mutex::new(String::new()));
        let errors = child.stderr.take().expect("piped stderr");
        let kept = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(errors).lines() {
                let Ok(line) = line else { break };
                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                kept.push_str(&line);
                kept.push('\n');
            }
        });
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        CuratorProcess {
            name: format!(
                "curator#{} {} {path}",
                NEXT.fetch_add(1, Ordering::Relaxed),
                command.join(" ")
            ),
            child,
            stdin,
            lines,
            stderr,
        }
    }
}

/// One line a `CuratorLock` process printed: `<word> [args...]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// `acquired`, `released`, `lost`, `reconnected`, `done`.
    pub word: String,
    pub args: Vec<String>,
}

impl Event {
    fn parse(line: &str) -> Self {
        let mut words = line.split_whitespace().map(str::to_owned);
        Event {
            word: words.next().unwrap_or_default(),
            args: words.collect(),
        }
    }

    /// The event's time, microseconds since the Unix epoch: the first argument of
    /// `acquired`, `released` (taken right before the release call; the second is when
    /// it returned), `lost` and `reconnected`.
    pub fn micros(&self) -> u64 {
        self.args
            .first()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no time in {self:?}"))
    }
}

/// A running `CuratorLock` process; killed (SIGKILL) and reaped on drop.
pub struct CuratorProcess {
    /// For messages: which process, running which command.
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: UnboundedReceiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl CuratorProcess {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process printed on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The next event, or `None` once the process closed its stdout (it exited).
    /// Panics if none comes within `within`.
    pub async fn next_event(&mut self, within: Duration) -> Option<Event> {
        match tokio::time::timeout(within, self.lines.recv()).await {
            Ok(line) => line.map(|l| Event::parse(&l)),
            Err(_) => panic!(
                "{}: no line within {within:?}; stderr:\n{}",
                self.name,
                self.stderr()
            ),
        }
    }

    /// The next event, which must be `word`; panics otherwise, or if none comes within
    /// `within`.
    pub async fn expect(&mut self, word: &str, within: Duration) -> Event {
        match self.next_event(within).await {
            Some(event) if event.word == word => event,
            other => panic!(
                "{}: expected {word:?}, got {other:?}; stderr:\n{}",
                self.name,
                self.stderr()
            ),
        }
    }

    /// Tells a `hold` process to release (a line `release` on its stdin).
    pub fn release(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin is open");
        writeln!(stdin, "release")
            .and_then(|()| stdin.flush())
            .unwrap_or_else(|e| panic!("{}: writing `release`: {e}", self.name));
    }

    /// Waits (up to `within`) for the process to exit; its status. Panics on timeout.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("the process's status") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{}: did not exit within {within:?}; stderr:\n{}",
                self.name,
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Reads every remaining event until the process exits, which it must do
    /// successfully within `within`; the events.
    pub async fn finish(&mut self, within: Duration) -> Vec<Event> {
        let deadline = Instant::now() + within;
        let mut events = Vec::new();
        while let Some(event) = self
            .next_event(deadline.saturating_duration_since(Instant::now()))
            .await
        {
            events.push(event);
        }
        let status = self
            .wait_exit(deadline.saturating_duration_since(Instant::now()))
            .await;
        assert!(
            status.success(),
            "{}: exited with {status}; stderr:\n{}",
            self.name,
            self.stderr()
        );
        events
    }

    /// Freezes the client (SIGSTOP): its session's heartbeats stop.
    pub fn pause(&self) {
        pause_process(self.pid());
    }

    /// Thaws a paused client (SIGCONT).
    pub fn resume(&self) {
        resume_process(self.pid());
    }

    /// Kills the client (SIGKILL) and reaps it: its session is left to expire.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for CuratorProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A counter file for `hammer`s, holding `0` when made; removed on drop.
pub struct CounterFile {
    path: PathBuf,
}

impl CounterFile {
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "tower-lock-counter-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, "0").expect("write the counter file");
        CounterFile { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The number in the file.
    pub fn read(&self) -> u64 {
        let text = std::fs::read_to_string(&self.path).expect("read the counter file");
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("not a number in the counter file: {text:?}"))
    }
}

impl Drop for CounterFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
