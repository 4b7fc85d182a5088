//! The fault proxy of the test harness (`tests/it/common/proxy.rs`) against a real
//! redis-server: each fault does what the safety tests rely on it to do, judged by what
//! the server itself saw over a direct connection.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::proxy::{Direction, FaultProxy, Flow};
use common::redis_server::RedisServer;
use common::wait_until;
use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout};

/// A generous bound for anything that should happen promptly.
const WITHIN: Duration = Duration::from_secs(5);

async fn server_and_proxy() -> (RedisServer, FaultProxy) {
    let server = RedisServer::start().await;
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], server.port()))).await;
    (server, proxy)
}

/// A redis-rs connection through the proxy without a response timeout: an answer the
/// proxy holds back comes late instead of failing the command.
async fn try_connect(proxy: &FaultProxy) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new().set_response_timeout(None);
    redis::Client::open(format!("redis://127.0.0.1:{}", proxy.port()))?
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

async fn connect(proxy: &FaultProxy) -> MultiplexedConnection {
    try_connect(proxy).await.expect("connect through the proxy")
}

async fn set(mut conn: MultiplexedConnection, key: &str, value: &str) -> redis::RedisResult<()> {
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query_async(&mut conn)
        .await
}

async fn get(mut conn: MultiplexedConnection, key: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn)
        .await
        .expect("GET")
}

/// How many clients the server has, `direct` included.
async fn clients(mut direct: MultiplexedConnection) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut direct)
        .await
        .expect("CLIENT LIST");
    list.lines().count()
}

/// A command in RESP, for a raw socket whose bytes the test controls exactly.
fn resp(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len());
    for arg in args {
        out += &format!("${}\r\n{arg}\r\n", arg.len());
    }
    out.into_bytes()
}

/// Reads the next reply on `raw`, which must be exactly `expected`.
async fn expect_reply(raw: &mut TcpStream, expected: &[u8]) {
    let mut reply = vec![0; expected.len()];
    timeout(WITHIN, raw.read_exact(&mut reply))
        .await
        .expect("a reply in time")
        .expect("read a reply");
    assert_eq!(
        String::from_utf8_lossy(&reply),
        String::from_utf8_lossy(expected)
    );
}

/// The proxy resets `raw`: an abrupt end, not an orderly close.
async fn expect_reset(raw: &mut TcpStream) {
    let mut buf = [0; 64];
    let read = timeout(WITHIN, raw.read(&mut buf))
        .await
        .expect("the connection ends in time");
    assert_eq!(
        read.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionReset)
    );
}

#[tokio::test]
async fn passes_commands_and_answers_through() {
    let (server, proxy) = server_and_proxy().await;
    let conn = connect(&proxy).await;
    set(conn.clone(), "plain", "through").await.unwrap();
    assert_eq!(get(conn.clone(), "plain").await.as_deref(), Some("through"));
    assert_eq!(
        get(server.conn().await, "plain").await.as_deref(),
        Some("through")
    );
    let stats = proxy.stats();
    assert_eq!((stats.accepted, stats.refused, stats.open), (1, 0, 1));
    for traffic in [stats.up, stats.down] {
        assert!(traffic.forwarded > 0, "{stats:?}");
        assert_eq!(traffic.forwarded, traffic.received, "{stats:?}");
        assert_eq!((traffic.discarded, traffic.closed), (0, 0), "{stats:?}");
    }

    drop(conn);
    wait_until(WITHIN, "the connection ends on both sides", || async {
        let stats = proxy.stats();
        (stats.open, stats.up.closed, stats.down.closed) == (0, 1, 1)
    })
    .await;
}

#[tokio::test]
async fn a_trapped_write_waits_for_its_release_while_other_connections_pass() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let trapped = connect(&proxy).await;
    let other = connect(&proxy).await;
    let trap = proxy.trap(Direction::Up, b"trapped-key");
    let pending = tokio::spawn(set(trapped, "trapped-key", "late"));
    timeout(WITHIN, trap.caught())
        .await
        .expect("the SET is caught");

    set(other, "other-key", "on time").await.unwrap();
    assert_eq!(
        get(direct.clone(), "other-key").await.as_deref(),
        Some("on time")
    );
    assert_eq!(
        get(direct.clone(), "trapped-key").await,
        None,
        "the trapped SET reached the server before its release"
    );
    assert!(!pending.is_finished(), "the trapped SET was answered");

    trap.release();
    timeout(WITHIN, pending)
        .await
        .expect("answered after the release")
        .unwrap()
        .unwrap();
    assert_eq!(get(direct, "trapped-key").await.as_deref(), Some("late"));
}

/// The late write of a client that gave up: it reaches the server when released, and
/// only then does the server see that client's connection close.
#[tokio::test]
async fn a_write_released_after_its_client_left_still_arrives_then_closes() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let alone = clients(direct.clone()).await;
    let conn = connect(&proxy).await;
    assert_eq!(clients(direct.clone()).await, alone + 1);
    let trap = proxy.trap(Direction::Up, b"left-behind");
    let pending = tokio::spawn(set(conn, "left-behind", "written before the close"));
    timeout(WITHIN, trap.caught())
        .await
        .expect("the SET is caught");

    // The client gives up: the task owned the connection's only handle.
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());
    wait_until(WITHIN, "the proxy sees the client close", || async {
        proxy.stats().up.closed == 1
    })
    .await;
    assert_eq!(get(direct.clone(), "left-behind").await, None);
    assert_eq!(
        clients(direct.clone()).await,
        alone + 1,
        "the upstream side closed while the proxy held a write for it"
    );

    trap.release();
    wait_until(WITHIN, "the held SET is applied", || async {
        get(direct.clone(), "left-behind").await.as_deref() == Some("written before the close")
    })
    .await;
    wait_until(WITHIN, "the server sees the close", || async {
        clients(direct.clone()).await == alone
    })
    .await;
    wait_until(WITHIN, "both pumps end", || async {
        proxy.stats().open == 0
    })
    .await;
}

/// Discarding through a raw socket, so that the test knows each byte the client sent:
/// the server answers a connection's commands in order, so once it has answered the SET
/// sent after the discarded one, the discarded one would have been applied had it come.
#[tokio::test]
async fn a_discarding_direction_delivers_nothing() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let mut raw = TcpStream::connect(proxy.addr()).await.unwrap();
    proxy.set_flow(Direction::Up, Flow::Discard);
    let dropped = resp(&["SET", "dropped-key", "x"]);
    raw.write_all(&dropped).await.unwrap();
    wait_until(WITHIN, "the proxy has thrown the SET away", || async {
        proxy.stats().up.discarded == dropped.len() as u64
    })
    .await;

    proxy.set_flow(Direction::Up, Flow::Pass);
    let kept = resp(&["SET", "kept-key", "y"]);
    raw.write_all(&kept).await.unwrap();
    expect_reply(&mut raw, b"+OK\r\n").await;
    assert_eq!(get(direct.clone(), "kept-key").await.as_deref(), Some("y"));
    assert_eq!(get(direct, "dropped-key").await, None);
    assert_eq!(proxy.stats().up.forwarded, kept.len() as u64);
}

/// A caught write thrown away: the connection's later write waits behind it until then,
/// and is delivered after it.
#[tokio::test]
async fn a_discarded_catch_never_arrives_and_holds_its_connection_until_then() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let other = connect(&proxy).await;
    let mut raw = TcpStream::connect(proxy.addr()).await.unwrap();
    let trap = proxy.trap(Direction::Up, b"caught-key");
    let caught = resp(&["SET", "caught-key", "x"]);
    raw.write_all(&caught).await.unwrap();
    timeout(WITHIN, trap.caught())
        .await
        .expect("the SET is caught");
    let received = proxy.stats().up.received;
    let behind = resp(&["SET", "behind-key", "y"]);
    raw.write_all(&behind).await.unwrap();
    wait_until(WITHIN, "the proxy has read the second SET", || async {
        proxy.stats().up.received == received + behind.len() as u64
    })
    .await;

    // A round trip on another connection: the second SET, were it not queued behind the
    // caught one, would have been forwarded by now.
    set(other, "other-key", "z").await.unwrap();
    assert_eq!(
        get(direct.clone(), "behind-key").await,
        None,
        "a later write overtook the caught one"
    );

    trap.discard();
    expect_reply(&mut raw, b"+OK\r\n").await;
    assert_eq!(
        get(direct.clone(), "behind-key").await.as_deref(),
        Some("y")
    );
    assert_eq!(get(direct, "caught-key").await, None);
    let up = proxy.stats().up;
    assert_eq!(up.discarded, caught.len() as u64);
}

#[tokio::test]
async fn holding_answers_lets_the_command_apply_but_not_the_reply() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let conn = connect(&proxy).await;
    let answered = proxy.stats().down.received;
    proxy.set_flow(Direction::Down, Flow::Hold);
    let pending = tokio::spawn(set(conn, "applied", "unanswered"));
    wait_until(WITHIN, "the server's answer is in the proxy", || async {
        proxy.stats().down.received > answered
    })
    .await;
    assert_eq!(get(direct, "applied").await.as_deref(), Some("unanswered"));
    assert!(!pending.is_finished(), "an answer passed a held direction");

    proxy.set_flow(Direction::Down, Flow::Pass);
    timeout(WITHIN, pending)
        .await
        .expect("answered after the release")
        .unwrap()
        .unwrap();
}

/// Two writes on one connection: the first read under a delay, the second after the
/// delay was lifted. The second is due at once but must not overtake the first.
#[tokio::test]
async fn a_delay_delays_each_write_and_keeps_their_order() {
    const DELAY: Duration = Duration::from_millis(400);
    let (server, proxy) = server_and_proxy().await;
    let conn = connect(&proxy).await;
    proxy.set_flow(Direction::Up, Flow::Delay(DELAY));
    let started = Instant::now();
    let received = proxy.stats().up.received;
    let first = tokio::spawn({
        let conn = conn.clone();
        async move { set(conn, "order", "first").await.map(|()| Instant::now()) }
    });
    wait_until(WITHIN, "the proxy has read the first SET", || async {
        proxy.stats().up.received > received
    })
    .await;

    proxy.set_flow(Direction::Up, Flow::Pass);
    let second =
        tokio::spawn(async move { set(conn, "order", "second").await.map(|()| Instant::now()) });
    let first_answered = timeout(WITHIN, first).await.unwrap().unwrap().unwrap();
    let second_answered = timeout(WITHIN, second).await.unwrap().unwrap().unwrap();
    for answered in [first_answered, second_answered] {
        let took = answered - started;
        assert!(took >= DELAY, "answered after {took:?}, under the delay");
        assert!(took < WITHIN, "answered after {took:?}");
    }
    assert_eq!(
        get(server.conn().await, "order").await.as_deref(),
        Some("second"),
        "the second SET overtook the first"
    );
}

#[tokio::test]
async fn a_cut_breaks_current_connections_and_a_new_one_works() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let alone = clients(direct.clone()).await;
    let conn = connect(&proxy).await;
    set(conn.clone(), "survives", "the cut").await.unwrap();
    let mut raw = TcpStream::connect(proxy.addr()).await.unwrap();
    raw.write_all(&resp(&["PING"])).await.unwrap();
    expect_reply(&mut raw, b"+PONG\r\n").await;
    assert_eq!(clients(direct.clone()).await, alone + 2);

    proxy.cut();
    expect_reset(&mut raw).await;
    wait_until(WITHIN, "the server loses the connection", || async {
        clients(direct.clone()).await == alone
    })
    .await;
    wait_until(WITHIN, "both pumps end", || async {
        proxy.stats().open == 0
    })
    .await;
    let after = timeout(WITHIN, set(conn, "through", "a cut connection"))
        .await
        .expect("an error, not a hang");
    assert!(after.is_err(), "a cut connection still works");

    let fresh = connect(&proxy).await;
    assert_eq!(get(fresh, "survives").await.as_deref(), Some("the cut"));
    assert_eq!(proxy.stats().accepted, 3);
}

#[tokio::test]
async fn refused_connections_never_reach_the_server() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let alone = clients(direct.clone()).await;
    proxy.refuse(true);
    let refused = timeout(WITHIN, try_connect(&proxy))
        .await
        .expect("an error, not a hang");
    assert!(refused.is_err(), "a connection got through while refusing");
    let mut raw = TcpStream::connect(proxy.addr()).await.unwrap();
    expect_reset(&mut raw).await;
    let stats = proxy.stats();
    assert_eq!((stats.refused, stats.open), (2, 0), "{stats:?}");
    assert_eq!(clients(direct.clone()).await, alone);

    proxy.refuse(false);
    let conn = connect(&proxy).await;
    set(conn, "after", "refusal").await.unwrap();
    assert_eq!(get(direct, "after").await.as_deref(), Some("refusal"));
}

/// Nothing outlives the proxy: not its listener, not a connection's pumps, not one
/// holding a write.
#[tokio::test]
async fn dropping_the_proxy_closes_its_port_and_connections() {
    let (server, proxy) = server_and_proxy().await;
    let direct = server.conn().await;
    let alone = clients(direct.clone()).await;
    let conn = connect(&proxy).await;
    proxy.set_flow(Direction::Up, Flow::Hold);
    let pending = tokio::spawn(set(conn, "held", "when the proxy went"));
    wait_until(WITHIN, "the proxy holds the SET", || async {
        proxy.stats().up.received > proxy.stats().up.forwarded
    })
    .await;
    let addr = proxy.addr();
    assert_eq!(clients(direct.clone()).await, alone + 1);

    drop(proxy);
    wait_until(WITHIN, "the server loses the connection", || async {
        clients(direct.clone()).await == alone
    })
    .await;
    let result = timeout(WITHIN, pending)
        .await
        .expect("the client sees its connection end")
        .unwrap();
    assert!(result.is_err(), "the held SET was answered");
    assert_eq!(get(direct, "held").await, None);
    wait_until(WITHIN, "the port refuses connections", || async {
        TcpStream::connect(addr).await.is_err()
    })
    .await;
}
