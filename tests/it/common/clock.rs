//! A clock step for a server the test starts: `clockshift.c`, preloaded into the
//! server (`LD_PRELOAD`), shifts its wall clock (`CLOCK_REALTIME`, `gettimeofday`,
//! `time`) by the microseconds in a file the test writes, read on every call, so a test
//! steps a running server's clock as NTP or an administrator would. Monotonic clocks
//! stay as they are, as a step leaves them. Built with the machine's `gcc` once per
//! test binary (`.ci/run` installs it).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The shim, compiled into the temporary directory (readable by the `postgres` user a
/// PostgreSQL server of a test runs as).
fn shim() -> &'static PathBuf {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/common/clockshift.c");
        // In Cargo's scratch directory for tests, not /tmp: every run built one there
        // and left it behind.
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tower-lock-clockshift-{}.so", std::process::id()));
        let status = std::process::Command::new("gcc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&out)
            .arg(&source)
            .arg("-ldl")
            .status()
            .expect("gcc, to build the clock shim (.ci/run installs it)");
        assert!(status.success(), "building the clock shim failed");
        out
    })
}

/// One server's clock offset, stepped by the test.
pub struct ClockShift {
    file: PathBuf,
}

impl ClockShift {
    /// An offset of zero, for a server yet to start with [`ClockShift::env`].
    pub fn new() -> Self {
        let file = std::env::temp_dir().join(format!(
            "tower-lock-clock-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let shift = ClockShift { file };
        shift.set(0);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&shift.file, std::fs::Permissions::from_mode(0o644)).unwrap();
        shift
    }

    /// What the server's environment needs for the shim to shift its clock.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), shim().to_string_lossy().into_owned()),
            (
                "CLOCKSHIFT_FILE".into(),
                self.file.to_string_lossy().into_owned(),
            ),
        ]
    }

    /// Steps the server's wall clock to `micros` from the real one (negative: behind).
    pub fn set(&self, micros: i64) {
        // Written in place: the server has the file mapped.
        use std::io::{Seek, Write};
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.file)
            .unwrap();
        file.seek(std::io::SeekFrom::Start(0)).unwrap();
        file.write_all(&micros.to_le_bytes()).unwrap();
    }

    /// Steps the server's clock `by` ahead of the real one.
    pub fn ahead(&self, by: Duration) {
        self.set(i64::try_from(by.as_micros()).unwrap());
    }

    /// Steps the server's clock `by` behind the real one.
    pub fn behind(&self, by: Duration) {
        self.set(-i64::try_from(by.as_micros()).unwrap());
    }
}

impl Drop for ClockShift {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
    }
}
