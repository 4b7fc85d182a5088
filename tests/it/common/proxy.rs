//! A fault-injecting TCP proxy between a client and a real store, for safety tests.
//!
//! [`FaultProxy::start`] listens on a free loopback port and forwards every connection it
//! accepts to `upstream` (a redis-server, PostgreSQL, ...) over a connection of its own.
//! The proxy can then delay, hold back, drop or cut what flows, one [`Direction`] at a
//! time, while the test keeps talking to the store directly to see what arrived.
//!
//! # Model
//! Each connection has two pump tasks, one per direction: [`Direction::Up`] carries what
//! the client writes to the store, [`Direction::Down`] what the store answers. A pump
//! reads whatever its socket has (a "write": on loopback, one `write` of the sender, or
//! several that arrived together), queues it, and delivers its queue **in order**, so a
//! write held back holds back everything after it on that connection and direction, as
//! TCP would. Connections are independent of each other. The connection upstream is made
//! when the client's is accepted; if it fails, the client's is reset.
//!
//! What happens to a queued write is decided by controls that apply to every connection,
//! current and future, and may change at any time while traffic flows:
//! - the direction's [`Flow`] (set with [`FaultProxy::set_flow`]): pass, hold until the
//!   flow changes, delay each write by a fixed time after it was read, or discard;
//! - a [`Trap`] ([`FaultProxy::trap`]) catches the next write in a direction that contains
//!   a byte pattern, on whichever connection it comes, and holds it (with the rest of that
//!   connection's direction) until the test releases or discards it; other connections
//!   flow on. [`Trap::caught`] waits, without polling, until it has caught one;
//! - [`FaultProxy::cut`] resets every current connection on both sides, and
//!   [`FaultProxy::refuse`] turns new connections away, as a partition or a store that is
//!   gone would.
//!
//! # Ends of streams
//! When a side closes its sending direction (or its socket fails), the pump still delivers
//! what it had already read, held, delayed or trapped, and only then closes the other
//! side's write half, as a kernel sends a closed socket's buffered data before its FIN. So
//! a write that a trap held while the client went away reaches the store when released,
//! and the store sees the close after it. A pump whose receiving side is gone stops.
//!
//! # Not modelled
//! Backpressure (a pump reads eagerly and buffers without bound while it holds), partial
//! delivery of a write, and loss of anything but whole writes.
//!
//! # Cleanup
//! Dropping the [`FaultProxy`] stops its listener and every pump task, which closes every
//! socket it had. I/O errors end a pump quietly; nothing in the proxy's tasks panics.
//!
//! # Example
//! ```ignore
//! let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
//! let trap = proxy.trap(Direction::Up, b"my-key");
//! // ... a client sends `SET my-key v` through proxy.port() ...
//! trap.caught().await; // the SET is in the proxy, not on the server
//! trap.release(); // now it arrives, late
//! ```

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// The longest pattern a [`Trap`] takes; a pattern split across two reads still matches.
pub const MAX_PATTERN: usize = 1024;

/// How much a pump reads at once.
const READ_SIZE: usize = 64 * 1024;

/// Which way bytes flow through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client to store: requests.
    Up,
    /// Store to client: answers.
    Down,
}

impl Direction {
    fn index(self) -> usize {
        self as usize
    }
}

/// What a direction does with the writes queued in it; see [`FaultProxy::set_flow`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Flow {
    /// Deliver each write as soon as it is due (at once, unless it was read under a delay).
    #[default]
    Pass,
    /// Deliver nothing; writes queue up. Setting another flow delivers them in order.
    Hold,
    /// Deliver each write this long after it was read, in order. A write's due time is
    /// fixed when it is read: changing the flow later neither hurries nor slows it, and a
    /// write read later never overtakes it.
    Delay(Duration),
    /// Throw writes away, queued ones included, as they come to be delivered.
    Discard,
}

/// A snapshot of what the proxy has done; see [`FaultProxy::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted, refused ones and ones whose upstream was unreachable included.
    pub accepted: u64,
    /// Connections turned away by [`FaultProxy::refuse`].
    pub refused: u64,
    /// Connections forwarded whose pumps have not both ended.
    pub open: u64,
    /// Client to store.
    pub up: Traffic,
    /// Store to client.
    pub down: Traffic,
}

/// One direction's counters, over every connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes read from the sending side.
    pub received: u64,
    /// Bytes written to the receiving side.
    pub forwarded: u64,
    /// Bytes thrown away ([`Flow::Discard`], [`Trap::discard`]).
    pub discarded: u64,
    /// Connections whose sending side has closed (end of stream or a read error).
    pub closed: u64,
}

/// A TCP proxy on a free loopback port that forwards to one upstream address and injects
/// faults on command; see the [module docs](self).
pub struct FaultProxy {
    addr: SocketAddr,
    controls: Arc<watch::Sender<Controls>>,
    counters: Arc<Counters>,
    listener: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on 127.0.0.1 on a free port and forwards every connection to `upstream`,
    /// with every direction passing.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let controls = Arc::new(watch::Sender::new(Controls::default()));
        let counters = Arc::new(Counters::default());
        let listener = tokio::spawn(listen(
            listener,
            upstream,
            controls.clone(),
            counters.clone(),
        ));
        FaultProxy {
            addr,
            controls,
            counters,
            listener,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Sets what `direction` does with writes, on every connection, from now on (queued
    /// writes included; see [`Flow`]). Setting [`Flow::Pass`] after [`Flow::Hold`]
    /// releases what was held, in order.
    pub fn set_flow(&self, direction: Direction, flow: Flow) {
        self.controls
            .send_modify(|c| c.flows[direction.index()] = flow);
    }

    /// Arms a trap for the next write read in `direction`, on any connection, that
    /// contains `pattern` (an empty pattern matches any write). One write is caught per
    /// trap; it is held, with its connection's later writes in that direction queued
    /// behind it, until [`Trap::release`] or [`Trap::discard`]. Writes read before this
    /// call are never caught. The proxy knows no protocol: what it holds is the whole read
    /// in which the pattern ends, with any commands pipelined into the same read.
    ///
    /// # Panics
    /// If `pattern` is longer than [`MAX_PATTERN`].
    pub fn trap(&self, direction: Direction, pattern: &[u8]) -> Trap {
        assert!(
            pattern.len() <= MAX_PATTERN,
            "trap patterns are at most {MAX_PATTERN} bytes"
        );
        let mut id = 0;
        self.controls.send_modify(|c| {
            id = c.next_trap;
            c.next_trap += 1;
            c.traps.push(TrapEntry {
                id,
                direction,
                pattern: pattern.to_vec(),
                state: TrapState::Armed,
            });
        });
        Trap {
            id,
            controls: self.controls.clone(),
        }
    }

    /// Cuts every connection open now: both of its sockets are closed with a reset (RST),
    /// and whatever the proxy had queued for it is lost. Later connections are not
    /// affected.
    pub fn cut(&self) {
        self.controls.send_modify(|c| c.cuts += 1);
    }

    /// While `refusing`, new connections are accepted and reset at once, never forwarded,
    /// as by a host whose store is gone. Current connections are not affected (see
    /// [`FaultProxy::cut`]).
    pub fn refuse(&self, refusing: bool) {
        self.controls.send_modify(|c| c.refusing = refusing);
    }

    /// Sends new connections to `upstream` from now on (a virtual address moved to a
    /// promoted standby). Current connections are not affected.
    pub fn redirect(&self, upstream: SocketAddr) {
        self.controls.send_modify(|c| c.redirected = Some(upstream));
    }

    /// What the proxy has done so far, for assertions.
    pub fn stats(&self) -> Stats {
        let count = |counter: &AtomicU64| counter.load(Ordering::SeqCst);
        let traffic = |t: &TrafficCounters| Traffic {
            received: count(&t.received),
            forwarded: count(&t.forwarded),
            discarded: count(&t.discarded),
            closed: count(&t.closed),
        };
        let c = &self.counters;
        Stats {
            accepted: count(&c.accepted),
            refused: count(&c.refused),
            open: count(&c.open),
            up: traffic(&c.traffic[Direction::Up.index()]),
            down: traffic(&c.traffic[Direction::Down.index()]),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The listener task owns the pumps' JoinSet: aborting it aborts them all.
        self.listener.abort();
    }
}

/// One armed trap; see [`FaultProxy::trap`]. Dropping it releases what it caught (or
/// disarms it), so a forgotten trap never wedges a connection.
#[must_use = "a trap is disarmed, and its write released, when it is dropped"]
pub struct Trap {
    id: u64,
    controls: Arc<watch::Sender<Controls>>,
}

impl Trap {
    /// Returns once the trap has caught a write (at once if it already has).
    pub async fn caught(&self) {
        let mut seen = self.controls.subscribe();
        // The sender lives in `self`, so this cannot fail.
        let _ = seen
            .wait_for(|c| c.trap_state(self.id) != Some(TrapState::Armed))
            .await;
    }

    /// Delivers the caught write, and what queued behind it, in order, as the direction's
    /// flow allows: late. If its connection's sending side has closed meanwhile, the
    /// receiving side gets the write first and the close after it. Disarms the trap if
    /// nothing was caught.
    pub fn release(self) {}

    /// Throws the caught write away; what queued behind it is delivered. Disarms the trap
    /// if nothing was caught.
    pub fn discard(self) {
        self.controls.send_modify(|c| {
            if let Some(trap) = c.traps.iter_mut().find(|t| t.id == self.id)
                && trap.state == TrapState::Holding
            {
                trap.state = TrapState::Discarding;
            }
        });
    }
}

impl Drop for Trap {
    fn drop(&mut self) {
        // A missing entry reads as "released"; a discarding one stays until its pump has
        // thrown the write away.
        self.controls.send_if_modified(|c| {
            let before = c.traps.len();
            c.traps
                .retain(|t| t.id != self.id || t.state == TrapState::Discarding);
            c.traps.len() != before
        });
    }
}

/// Everything a test can change, watched by every pump and by the listener.
#[derive(Default)]
struct Controls {
    flows: [Flow; 2],
    traps: Vec<TrapEntry>,
    next_trap: u64,
    /// How many cuts there have been; a connection ends when this moves past the value it
    /// was accepted under.
    cuts: u64,
    refusing: bool,
    /// Where new connections go instead of the upstream the proxy started with.
    redirected: Option<SocketAddr>,
}

impl Controls {
    fn trap_state(&self, id: u64) -> Option<TrapState> {
        self.traps.iter().find(|t| t.id == id).map(|t| t.state)
    }
}

struct TrapEntry {
    id: u64,
    direction: Direction,
    pattern: Vec<u8>,
    state: TrapState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TrapState {
    Armed,
    Holding,
    Discarding,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    refused: AtomicU64,
    open: AtomicU64,
    traffic: [TrafficCounters; 2],
}

#[derive(Default)]
struct TrafficCounters {
    received: AtomicU64,
    forwarded: AtomicU64,
    discarded: AtomicU64,
    closed: AtomicU64,
}

fn add(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::SeqCst);
}

async fn listen(
    listener: TcpListener,
    upstream: SocketAddr,
    controls: Arc<watch::Sender<Controls>>,
    counters: Arc<Counters>,
) {
    // Every pump lives in this set, so aborting this task drops them all.
    let mut pumps = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                if let Ok((client, _)) = accepted {
                    admit(client, upstream, &controls, &counters, &mut pumps).await;
                }
            }
            Some(_) = pumps.join_next() => {}
        }
    }
}

/// Turns `client` away, or connects it upstream and starts its two pumps.
async fn admit(
    client: TcpStream,
    upstream: SocketAddr,
    controls: &Arc<watch::Sender<Controls>>,
    counters: &Arc<Counters>,
    pumps: &mut JoinSet<()>,
) {
    add(&counters.accepted, 1);
    let (refusing, cuts, upstream) = {
        let c = controls.borrow();
        (c.refusing, c.cuts, c.redirected.unwrap_or(upstream))
    };
    if refusing {
        add(&counters.refused, 1);
        let _ = client.set_zero_linger();
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        let _ = client.set_zero_linger();
        return;
    };
    // A proxy must not add Nagle's delays to small writes it forwards.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    add(&counters.open, 1);
    let open = Arc::new(OpenConnection(counters.clone()));
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let ends = [
        (Direction::Up, client_read, server_write),
        (Direction::Down, server_read, client_write),
    ];
    for (direction, from, to) in ends {
        pumps.spawn(
            Pump {
                direction,
                from: Some(from),
                to,
                queue: VecDeque::new(),
                tail: Vec::new(),
                controls: controls.clone(),
                seen: controls.subscribe(),
                cuts,
                counters: counters.clone(),
                _open: open.clone(),
            }
            .run(),
        );
    }
}

/// Counts a connection open until both of its pumps have ended.
struct OpenConnection(Arc<Counters>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One direction of one connection.
struct Pump {
    direction: Direction,
    /// `None` once the sending side has closed.
    from: Option<OwnedReadHalf>,
    to: OwnedWriteHalf,
    queue: VecDeque<Chunk>,
    /// The stream's last bytes, so that a trap's pattern split across two reads matches.
    tail: Vec<u8>,
    controls: Arc<watch::Sender<Controls>>,
    seen: watch::Receiver<Controls>,
    /// `Controls::cuts` when this connection was accepted.
    cuts: u64,
    counters: Arc<Counters>,
    _open: Arc<OpenConnection>,
}

/// A write read by a pump and not yet delivered.
struct Chunk {
    bytes: Vec<u8>,
    /// When it may be delivered (its read time, plus the delay it was read under).
    due: Instant,
    /// The trap that caught it.
    trap: Option<u64>,
}

/// What a pump does next with the front of its queue.
enum Step {
    Forward,
    Discard,
    /// Read on, and look again when the controls change or at the given time.
    Wait(Option<Instant>),
    /// The sending side has closed and everything is delivered: close the receiving side.
    Finish,
    Cut,
}

/// Why a pump stops.
enum Stop {
    Cut,
    /// Its work is over: everything was delivered and the receiving side closed, or the
    /// receiving side is gone.
    Done,
}

impl Pump {
    async fn run(mut self) {
        let mut buf = vec![0; READ_SIZE];
        loop {
            let stopped = match self.next_step() {
                Step::Forward => self.forward().await.err(),
                Step::Discard => {
                    self.discard_front();
                    None
                }
                Step::Wait(until) => {
                    self.wait(until, &mut buf).await;
                    None
                }
                Step::Finish => Some(self.finish().await),
                Step::Cut => Some(Stop::Cut),
            };
            match stopped {
                None => {}
                Some(Stop::Done) => return,
                Some(Stop::Cut) => return self.reset(),
            }
        }
    }

    fn next_step(&mut self) -> Step {
        let controls = self.seen.borrow_and_update();
        if controls.cuts != self.cuts {
            return Step::Cut;
        }
        let Some(chunk) = self.queue.front() else {
            return match self.from {
                Some(_) => Step::Wait(None),
                None => Step::Finish,
            };
        };
        match chunk.trap.and_then(|id| controls.trap_state(id)) {
            Some(TrapState::Holding) => return Step::Wait(None),
            Some(TrapState::Discarding) => return Step::Discard,
            // Released (its entry is gone).
            Some(TrapState::Armed) | None => {}
        }
        match controls.flows[self.direction.index()] {
            Flow::Hold => Step::Wait(None),
            Flow::Discard => Step::Discard,
            Flow::Pass | Flow::Delay(_) if chunk.due > Instant::now() => {
                Step::Wait(Some(chunk.due))
            }
            Flow::Pass | Flow::Delay(_) => Step::Forward,
        }
    }

    /// Writes the front chunk to the receiving side, unless a cut comes first.
    async fn forward(&mut self) -> Result<(), Stop> {
        let chunk = self.queue.pop_front().expect("a chunk to forward");
        let cuts = self.cuts;
        tokio::select! {
            written = self.to.write_all(&chunk.bytes) => match written {
                Ok(()) => {
                    add(&self.traffic().forwarded, chunk.bytes.len());
                    Ok(())
                }
                Err(_) => Err(Stop::Done),
            },
            () = cut_since(&mut self.seen, cuts) => Err(Stop::Cut),
        }
    }

    fn discard_front(&mut self) {
        let chunk = self.queue.pop_front().expect("a chunk to discard");
        add(&self.traffic().discarded, chunk.bytes.len());
        if let Some(id) = chunk.trap {
            // The trap was told to discard: it is done with.
            self.controls.send_if_modified(|c| {
                let before = c.traps.len();
                c.traps.retain(|t| t.id != id);
                c.traps.len() != before
            });
        }
    }

    /// Reads from the sending side until the controls change or `until` comes.
    async fn wait(&mut self, until: Option<Instant>, buf: &mut [u8]) {
        tokio::select! {
            biased;
            // The sender lives in `self.controls`, so this cannot fail.
            _ = self.seen.changed() => {}
            read = read_some(self.from.as_mut(), buf) => self.receive(read, buf),
            _ = sleep_until(until) => {}
        }
    }

    fn receive(&mut self, read: io::Result<usize>, buf: &[u8]) {
        let n = match read {
            Ok(n) if n > 0 => n,
            // End of stream or a broken socket: the sender is done.
            _ => {
                self.from = None;
                add(&self.traffic().closed, 1);
                return;
            }
        };
        let bytes = buf[..n].to_vec();
        add(&self.traffic().received, n);
        let now = Instant::now();
        let due = match self.seen.borrow().flows[self.direction.index()] {
            Flow::Delay(delay) => now + delay,
            _ => now,
        };
        let trap = self.catch(&bytes);
        self.queue.push_back(Chunk { bytes, due, trap });
    }

    /// The first armed trap of this direction whose pattern `bytes` completes, now
    /// holding.
    fn catch(&mut self, bytes: &[u8]) -> Option<u64> {
        let mut caught = None;
        self.controls.send_if_modified(|c| {
            let Some(trap) = c.traps.iter_mut().find(|t| {
                t.state == TrapState::Armed
                    && t.direction == self.direction
                    && completes(&self.tail, bytes, &t.pattern)
            }) else {
                return false;
            };
            trap.state = TrapState::Holding;
            caught = Some(trap.id);
            true
        });
        self.tail.extend_from_slice(bytes);
        let excess = self.tail.len().saturating_sub(MAX_PATTERN - 1);
        self.tail.drain(..excess);
        caught
    }

    /// Closes the receiving side's write half (FIN) after everything was delivered.
    async fn finish(&mut self) -> Stop {
        let cuts = self.cuts;
        tokio::select! {
            _ = self.to.shutdown() => Stop::Done,
            () = cut_since(&mut self.seen, cuts) => Stop::Cut,
        }
    }

    /// Drops this pump's sockets so that each sends a reset (RST), not a FIN, once the
    /// other pump has let go of it too.
    fn reset(self) {
        let _ = self.to.as_ref().set_zero_linger();
        if let Some(from) = &self.from {
            let _ = from.as_ref().set_zero_linger();
        }
        // Dropping a write half would shut it down, sending a FIN ahead of the reset.
        self.to.forget();
    }

    fn traffic(&self) -> &TrafficCounters {
        &self.counters.traffic[self.direction.index()]
    }
}

/// Whether `pattern` occurs in the stream `tail ++ bytes` and ends inside `bytes`.
fn completes(tail: &[u8], bytes: &[u8], pattern: &[u8]) -> bool {
    if pattern.is_empty() {
        return true;
    }
    let carried = tail.len().min(pattern.len() - 1);
    let mut stream = tail[tail.len() - carried..].to_vec();
    stream.extend_from_slice(bytes);
    stream.windows(pattern.len()).any(|w| w == pattern)
}

/// Returns once a cut has come since the one numbered `cuts`.
async fn cut_since(seen: &mut watch::Receiver<Controls>, cuts: u64) {
    // The sender outlives every pump, so this cannot fail.
    let _ = seen.wait_for(|c| c.cuts != cuts).await;
}

/// Reads from `from`, or never returns once the sending side has closed.
async fn read_some(from: Option<&mut OwnedReadHalf>, buf: &mut [u8]) -> io::Result<usize> {
    match from {
        Some(from) => from.read(buf).await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(until: Option<Instant>) {
    match until {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
