//! The ZooKeeper harness itself (`common::zookeeper`, `common::curator`): what the
//! ZooKeeper backend's tests rely on. A standalone server answers and comes back on its
//! port with its data and live sessions; an ensemble elects a new leader when its leader
//! dies and takes the old one back; Curator's mutex and write lock exclude each other
//! across processes; Curator's event times order a release before the wake-up it
//! causes, so that wake-up delays can be measured from them; and a Curator holder frozen
//! past its session timeout loses the lock and says so once thawed.

use std::time::{Duration, SystemTime};

use crate::common::curator::{CounterFile, Curator, CuratorProcess, Event, Mode};
use crate::common::wait_until;
use crate::common::zookeeper::{ZkEnsemble, ZkServer};

/// Long enough for a client JVM to start and connect on a loaded two-core machine.
const CLIENT_START: Duration = Duration::from_secs(30);

#[tokio::test]
async fn standalone_server_restarts_on_its_port_with_its_sessions() {
    let mut server = ZkServer::start().await;
    assert_eq!(server.four_letter("ruok").await.as_deref(), Some("imok"));
    assert_eq!(server.mode().await.as_deref(), Some("standalone"));
    let port = server.port();

    // A live session's ephemeral lock node, to see the data survive the restart.
    let mut holder = Curator::new(server.connect_string())
        .session_timeout(Duration::from_secs(20))
        .hold("/restart", Mode::Mutex);
    holder.expect("acquired", CLIENT_START).await;
    let held = server.ephemerals().await;
    assert_eq!(held.len(), 1, "the holder's lock node: {held:?}");
    assert!(held[0].starts_with("/restart/"), "{held:?}");

    server.stop();
    assert_eq!(server.pid(), None);
    assert_eq!(
        server.four_letter("ruok").await,
        None,
        "the stopped server answers"
    );
    holder.expect("lost", Duration::from_secs(10)).await;

    server.start_again().await;
    assert_eq!(server.port(), port);
    assert_eq!(server.four_letter("ruok").await.as_deref(), Some("imok"));
    assert_eq!(
        server.ephemerals().await,
        held,
        "the live session's lock node survives the restart"
    );
    holder.expect("reconnected", Duration::from_secs(15)).await;

    holder.release();
    holder.expect("released", Duration::from_secs(10)).await;
    assert!(holder.wait_exit(Duration::from_secs(10)).await.success());
    wait_until(
        Duration::from_secs(10),
        "the released lock node is gone",
        || async { server.ephemerals().await.is_empty() },
    )
    .await;
}

#[tokio::test]
async fn ensemble_elects_a_new_leader_and_takes_the_old_one_back() {
    let mut ensemble = ZkEnsemble::start(3).await;
    assert_eq!(ensemble.connect_string().split(',').count(), 3);
    let old = ensemble.leader().await;

    ensemble.kill(old);
    let killed_at = tokio::time::Instant::now();
    let new = ensemble.leader().await;
    let elected_after = killed_at.elapsed();
    println!("a new leader after {elected_after:?}");
    assert_ne!(new, old, "the dead leader still leads");
    assert!(
        elected_after < Duration::from_secs(20),
        "a new leader after {elected_after:?}"
    );

    ensemble.start_again(old).await;
    assert_eq!(
        ensemble.node(old).mode().await.as_deref(),
        Some("follower"),
        "the old leader rejoins under the new one"
    );
    assert_eq!(ensemble.leader().await, new);
    let modes = ensemble.modes().await;
    assert!(
        modes.iter().all(|m| m.is_some()),
        "every node serves: {modes:?}"
    );
}

/// Two `hammer`s of `mode` on one counter: every increment counted, and no two holds
/// overlap in time.
async fn hammers_count_every_increment(mode: Mode) {
    let server = ZkServer::start().await;
    let counter = CounterFile::new();
    let curator = Curator::new(server.connect_string());
    let mut hammers: Vec<CuratorProcess> = (0..2)
        .map(|_| curator.hammer("/hammer", mode, 100, counter.path()))
        .collect();
    let mut holds = Vec::new();
    for hammer in &mut hammers {
        let events = hammer.finish(Duration::from_secs(50)).await;
        assert_eq!(
            events.last(),
            Some(&Event {
                word: "done".into(),
                args: vec!["100".into()]
            })
        );
        holds.extend(hold_intervals(&events));
    }
    assert_eq!(counter.read(), 200, "an increment was lost");
    assert_eq!(holds.len(), 200);
    holds.sort_unstable();
    for pair in holds.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "two holds overlap: {:?} and {:?}",
            pair[0],
            pair[1]
        );
    }
}

/// Each hold's (`acquired`, `released`) times: `acquired` is taken after the acquire
/// returned and `released` before the release began, so the holds of an exclusive lock
/// never overlap.
fn hold_intervals(events: &[Event]) -> Vec<(u64, u64)> {
    let acquired = events.iter().filter(|e| e.word == "acquired");
    let released = events.iter().filter(|e| e.word == "released");
    acquired
        .zip(released)
        .map(|(a, r)| (a.micros(), r.micros()))
        .collect()
}

#[tokio::test]
async fn curator_mutex_hammers_count_every_increment() {
    hammers_count_every_increment(Mode::Mutex).await;
}

#[tokio::test]
async fn curator_write_lock_hammers_count_every_increment() {
    hammers_count_every_increment(Mode::Write).await;
}

#[tokio::test]
async fn curator_waiter_acquires_after_the_holders_release() {
    let server = ZkServer::start().await;
    let curator = Curator::new(server.connect_string());
    let mut holder = curator.hold("/wake", Mode::Mutex);
    holder.expect("acquired", CLIENT_START).await;
    let mut waiter = curator.wait("/wake", Mode::Mutex);
    // Queued: the waiter watches the holder's node (the holder watches nothing).
    wait_until(CLIENT_START, "the waiter watches the holder", || async {
        let watched = server.watched_paths().await;
        watched.iter().any(|p| p.starts_with("/wake/"))
    })
    .await;

    holder.release();
    let released = holder.expect("released", Duration::from_secs(10)).await;
    let acquired = waiter.expect("acquired", Duration::from_secs(10)).await;
    assert!(
        acquired.micros() >= released.micros(),
        "the waiter acquired at {} before the holder released at {}",
        acquired.micros(),
        released.micros()
    );
    let delay = Duration::from_micros(acquired.micros() - released.micros());
    // Tens of milliseconds, idle; seconds would mean it was not queued yet.
    assert!(delay < Duration::from_secs(2), "woken after {delay:?}");
    println!("Curator wake-up delay: {delay:?}");
    waiter.expect("released", Duration::from_secs(10)).await;
    assert!(waiter.wait_exit(Duration::from_secs(10)).await.success());
    assert!(holder.wait_exit(Duration::from_secs(10)).await.success());
}

#[tokio::test]
async fn a_curator_holder_frozen_past_its_session_loses_the_lock_and_says_so() {
    let server = ZkServer::start().await;
    let session = Duration::from_secs(2);
    let curator = Curator::new(server.connect_string()).session_timeout(session);
    let mut holder = curator.hold("/frozen", Mode::Mutex);
    holder.expect("acquired", CLIENT_START).await;
    let mut waiter = curator.wait("/frozen", Mode::Mutex);
    wait_until(CLIENT_START, "the waiter watches the holder", || async {
        let watched = server.watched_paths().await;
        watched.iter().any(|p| p.starts_with("/frozen/"))
    })
    .await;

    holder.pause();
    let frozen_at = epoch_micros();
    let acquired = waiter.expect("acquired", Duration::from_secs(15)).await;
    // The server expires the session a timeout after it last heard from the client,
    // which pings every third of it when idle.
    let taken_after = Duration::from_micros(acquired.micros().saturating_sub(frozen_at));
    assert!(
        taken_after >= session / 2,
        "the lock was taken {taken_after:?} after the holder froze (session {session:?})"
    );

    println!("the lock was taken over {taken_after:?} after the holder froze");
    holder.resume();
    // SUSPENDED first (it has not heard from the server for too long), then LOST (the
    // server says the session expired).
    loop {
        let event = holder.expect("lost", Duration::from_secs(15)).await;
        if event.args.get(1).map(String::as_str) == Some("LOST") {
            break;
        }
    }
    waiter.expect("released", Duration::from_secs(10)).await;
    assert!(waiter.wait_exit(Duration::from_secs(10)).await.success());
}

fn epoch_micros() -> u64 {
    let since = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap();
    u64::try_from(since.as_micros()).unwrap()
}
