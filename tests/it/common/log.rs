//! A log captured in memory, for tests of what an operator reads.

use std::sync::{Arc, Mutex};

/// A log written to memory.
#[derive(Clone, Default)]
pub struct Captured(pub Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// The lines at `level` (`WARN`, ...) that contain `text`.
    pub fn lines(&self, level: &str, text: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.split_whitespace().next() == Some(level) && l.contains(text))
            .map(str::to_owned)
            .collect()
    }

    /// The lines at `level`.
    pub fn at(&self, level: &str) -> Vec<String> {
        self.lines(level, "")
    }
}

/// Runs `test` on a current-thread runtime (so that every event is on this thread, and
/// time can jump) with a log at `level` captured.
pub fn with_log<F: std::future::Future<Output = ()>>(
    level: tracing::Level,
    test: impl FnOnce(Captured) -> F,
) {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .without_time()
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .finish();
    super::log_capture_sees_every_callsite();
    let _default = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(test(captured));
}
