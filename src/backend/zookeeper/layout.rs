//! Curator's node layouts, and what tower-lock writes into its own nodes.
//!
//! - `InterProcessMutex` at a path: ephemeral sequential children
//!   `_c_<uuid>-lock-<sequence>`, created in protected mode (the uuid finds a node whose
//!   creation answer was lost). The lowest sequence holds the lock.
//! - `InterProcessReadWriteLock`: the same, named `_c_<uuid>-__WRIT__<sequence>` and
//!   `_c_<uuid>-__READ__<sequence>`. A write node holds when it is the lowest; a read
//!   node when no write node is below it.
//! - `InterProcessSemaphoreV2`: an `InterProcessMutex` at `<path>/locks` guards the
//!   creation of lease nodes `_c_<uuid>-lease-<sequence>` under `<path>/leases`; a lease
//!   holds a permit once at most `max` lease nodes exist.
//!
//! Curator writes the client's address into its nodes; tower-lock writes
//! `tower-lock/1 <h|w> <ms> <hold id>`: a holder (`h`) and its lease, or a waiter (`w`)
//! and the waiter timeout. That lets other tower-lock clients end a hold whose lease ran
//! out (a fixed lease, or a watchdog that stopped) while its session lives on, and skip
//! a waiter that reached the head of the queue and never claimed it (its process lives,
//! its acquisition was leaked). A node with other data (Curator's) ends only with its
//! session.

use std::time::Duration;

use crate::backend::LockMode;

/// The protected-mode prefix Curator gives the nodes it creates.
const PROTECTED: &str = "_c_";
/// The data prefix of tower-lock's nodes.
const DATA_PREFIX: &str = "tower-lock/1 ";
/// The number of digits ZooKeeper gives a sequence.
const SEQUENCE_DIGITS: usize = 10;

/// What a lock node is, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NodeKind {
    /// `lock-`: an `InterProcessMutex` node (tower-lock's exclusive and fair locks).
    Mutex,
    /// `__WRIT__`.
    Write,
    /// `__READ__`.
    Read,
    /// `lease-`: an `InterProcessSemaphoreV2` lease.
    Lease,
}

impl NodeKind {
    /// The node kind a mode takes (for permits: its lease).
    pub(super) fn of(mode: LockMode) -> Self {
        match mode {
            LockMode::Exclusive | LockMode::Fair => NodeKind::Mutex,
            LockMode::Write => NodeKind::Write,
            LockMode::Read => NodeKind::Read,
            LockMode::Permits { .. } => NodeKind::Lease,
        }
    }

    /// The name Curator puts before the sequence.
    pub(super) fn name(self) -> &'static str {
        match self {
            NodeKind::Mutex => "lock-",
            NodeKind::Write => "__WRIT__",
            NodeKind::Read => "__READ__",
            NodeKind::Lease => "lease-",
        }
    }
}

/// One child of a lock's directory, parsed from its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Child {
    pub(super) name: String,
    pub(super) sequence: i64,
    pub(super) kind: NodeKind,
}

impl Child {
    /// Parses a child's name; `None` for a name that is no lock node (Curator's
    /// `locks`/`leases` directories of a semaphore at the same path, say). A sequential
    /// name of an unknown kind counts as a mutex node: it blocks, as Curator's sorter
    /// would have it.
    pub(super) fn parse(name: &str) -> Option<Child> {
        if name.len() <= SEQUENCE_DIGITS {
            return None;
        }
        let (head, digits) = name.split_at(name.len() - SEQUENCE_DIGITS);
        if !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let sequence = digits.parse().ok()?;
        let kind = if head.ends_with(NodeKind::Write.name()) {
            NodeKind::Write
        } else if head.ends_with(NodeKind::Read.name()) {
            NodeKind::Read
        } else if head.ends_with(NodeKind::Lease.name()) {
            NodeKind::Lease
        } else {
            NodeKind::Mutex
        };
        Some(Child {
            name: name.to_owned(),
            sequence,
            kind,
        })
    }
}

/// The protected-mode uuid of a node's name, if it has one.
pub(super) fn protected_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(PROTECTED)?;
    rest.get(..36)
        .filter(|_| rest.as_bytes().get(36) == Some(&b'-'))
}

/// The children of a directory that are lock nodes, by sequence.
pub(super) fn sorted(names: Vec<String>) -> Vec<Child> {
    let mut children: Vec<Child> = names.iter().filter_map(|n| Child::parse(n)).collect();
    children.sort_by_key(|c| c.sequence);
    children
}

/// The prefix a node is created with (ZooKeeper appends the sequence): protected, as
/// Curator creates them.
pub(super) fn node_prefix(dir: &str, uuid: &str, kind: NodeKind) -> String {
    format!("{dir}/{PROTECTED}{uuid}-{}", kind.name())
}

/// What decides whether the node at `index` of `children` holds, in its mode: `None`
/// when it does, else the node it waits for (the one to watch). `passes` lets a read
/// past one write node (Redisson's downgrade: the read's own writer).
pub(super) fn blocker<'a>(
    children: &'a [Child],
    index: usize,
    passes: Option<&str>,
) -> Option<&'a Child> {
    let me = children.get(index)?;
    match me.kind {
        NodeKind::Read => children[..index]
            .iter()
            .rev()
            .find(|c| c.kind != NodeKind::Read && Some(c.name.as_str()) != passes),
        _ => index.checked_sub(1).map(|i| &children[i]),
    }
}

/// The nodes that hold now, as the rules put it: the lowest node, and if it is a read,
/// every read below the first node of another kind.
pub(super) fn holders(children: &[Child]) -> &[Child] {
    match children.first() {
        None => &[],
        Some(first) if first.kind == NodeKind::Read => {
            let end = children
                .iter()
                .position(|c| c.kind != NodeKind::Read)
                .unwrap_or(children.len());
            &children[..end]
        }
        Some(_) => &children[..1],
    }
}

/// What a tower-lock node says of itself: holding (for its lease) or waiting (evicted
/// when it stays at the head unclaimed for the waiter timeout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    Holding,
    Waiting,
}

/// The data of a tower-lock node: its state, how long it lasts unchanged (the lease of
/// a holder, the waiter timeout of a waiter) and its hold identity.
pub(super) fn encode(state: State, lasts: Duration, hold_id: &str) -> Vec<u8> {
    let ms = lasts.as_millis().max(1);
    let state = match state {
        State::Holding => 'h',
        State::Waiting => 'w',
    };
    format!("{DATA_PREFIX}{state} {ms} {hold_id}").into_bytes()
}

/// A tower-lock node's state, how long it lasts unchanged, and its hold identity;
/// `None` for a node of another client (Curator's), which ends only with its session.
pub(super) fn decode(data: &[u8]) -> Option<(State, Duration, &str)> {
    let text = std::str::from_utf8(data).ok()?;
    let rest = text.strip_prefix(DATA_PREFIX)?;
    let (state, rest) = rest.split_once(' ')?;
    let state = match state {
        "h" => State::Holding,
        "w" => State::Waiting,
        _ => return None,
    };
    let (ms, hold_id) = rest.split_once(' ')?;
    let ms: u64 = ms.parse().ok()?;
    Some((state, Duration::from_millis(ms), hold_id))
}

/// Checks that `key`, put under the root, makes a valid ZooKeeper path: no empty
/// segment, no `.` or `..` segment, none of the characters ZooKeeper refuses.
pub(super) fn check_key(key: &str) -> Result<(), String> {
    for segment in key.split('/') {
        if segment.is_empty() {
            return Err(
                "a ZooKeeper path has no empty segment: no leading, trailing or doubled `/`".into(),
            );
        }
        if segment == "." || segment == ".." {
            return Err(format!("a ZooKeeper path has no `{segment}` segment"));
        }
    }
    if let Some(c) = key.chars().find(|&c| {
        matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}')
    }) {
        return Err(format!("ZooKeeper refuses the character {c:?} in a path"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "0f8e4c4e-51a3-4c5c-9a55-0c7d0b7a1e23";

    #[test]
    fn curator_names_parse_by_kind_and_sequence() {
        let c = Child::parse(&format!("_c_{UUID}-lock-0000000007")).unwrap();
        assert_eq!((c.kind, c.sequence), (NodeKind::Mutex, 7));
        assert_eq!(protected_of(&c.name), Some(UUID));
        let w = Child::parse(&format!("_c_{UUID}-__WRIT__0000000012")).unwrap();
        assert_eq!((w.kind, w.sequence), (NodeKind::Write, 12));
        let r = Child::parse("_c_x-__READ__0000000003").unwrap();
        assert_eq!(r.kind, NodeKind::Read);
        assert_eq!(protected_of(&r.name), None);
        assert_eq!(Child::parse("leases"), None);
        assert_eq!(Child::parse("lock-00000x0001"), None);
    }

    #[test]
    fn a_read_waits_for_the_last_write_below_it_unless_it_is_its_writer() {
        let children = sorted(vec![
            "_c_a-__READ__0000000001".into(),
            "_c_b-__WRIT__0000000002".into(),
            "_c_c-__READ__0000000003".into(),
            "_c_d-__WRIT__0000000004".into(),
        ]);
        assert_eq!(blocker(&children, 0, None), None);
        assert_eq!(blocker(&children, 1, None).unwrap().sequence, 1);
        assert_eq!(blocker(&children, 2, None).unwrap().sequence, 2);
        assert_eq!(blocker(&children, 2, Some("_c_b-__WRIT__0000000002")), None);
        assert_eq!(holders(&children).len(), 1);
        assert_eq!(holders(&children[2..]).len(), 1);
    }

    #[test]
    fn data_round_trips_and_curator_data_is_nobodys() {
        let data = encode(State::Holding, Duration::from_millis(1500), "client:7");
        assert_eq!(
            decode(&data),
            Some((State::Holding, Duration::from_millis(1500), "client:7"))
        );
        let data = encode(State::Waiting, Duration::from_millis(5), "c:1");
        assert_eq!(
            decode(&data),
            Some((State::Waiting, Duration::from_millis(5), "c:1"))
        );
        assert_eq!(decode(b"127.0.0.1"), None);
    }

    #[test]
    fn keys_must_make_paths() {
        assert!(check_key("orders/42").is_ok());
        assert!(check_key("a//b").is_err());
        assert!(check_key("/a").is_err());
        assert!(check_key("a/..").is_err());
        assert!(check_key("a\u{e000}").is_err());
    }
}
