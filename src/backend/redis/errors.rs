//! redis-rs's errors as this crate's: which are outages, which misconfigurations, and
//! which refusals say that the server may no longer be the primary.

use redis::RedisError;

use super::WrongType;
use crate::error::{Error, StoreError, StoreErrorKind};

/// `error`, from connecting to `addr` (`host:port`, never with the password the URL may
/// carry), saying where: an operator reading "connection refused" at startup needs to
/// know which server refused.
pub(super) fn naming_the_server(error: Error, addr: &str) -> Error {
    match error {
        Error::Store(store) => {
            let message = format!("cannot connect to Redis at {addr}: {}", store.message());
            Error::Store(store.with_message(message))
        }
        other => other,
    }
}

/// redis-rs's error → the crate's: a key of another type is [`WrongType`], any
/// other failure a [`StoreError`] of its kind.
pub(super) fn map_error(error: RedisError) -> Error {
    let wrong_type = error.code() == Some("WRONGTYPE")
        || error.detail().is_some_and(|d| d.contains("WRONGTYPE"))
        || error.to_string().contains("WRONGTYPE");
    if wrong_type {
        let message = format!("{WrongType}: {error}");
        Error::Store(
            StoreError::new(StoreErrorKind::Misconfigured, WrongType).with_message(message),
        )
    } else {
        Error::Store(store_error(error))
    }
}

/// The kind of a redis-rs error, with the error as the source. The server could not be
/// reached or did not answer (I/O, a dropped or refused connection, a timeout, a cluster
/// redirection or a cluster that is down, inside a script too), or refused the command
/// for now ([`REFUSED_FOR_NOW`]): unavailable; a connection that broke under the command
/// (not one that timed out) says so, for the lock core's retry. A reply redis-rs could
/// not parse or convert: unexpected. Anything else the server answered
/// (authentication, permissions, a script error): misconfigured; but a write refused by
/// a replica that was the primary (`READONLY`) is a connection to replace.
fn store_error(error: RedisError) -> StoreError {
    // The Sentinels named no primary: they are moving it (a failover), or cannot be
    // reached. An outage, as a primary that cannot be reached is; nothing was sent.
    #[cfg(feature = "sentinel")]
    if matches!(
        error.kind(),
        redis::ErrorKind::MasterNameNotFoundBySentinel
            | redis::ErrorKind::NoValidReplicasFoundBySentinel
    ) {
        return StoreError::not_applied(error).and_unanswered();
    }
    let unavailable = error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_timeout()
        || error.is_cluster_error()
        || cluster_refused_script(&error)
        || refused_for_now(&error);
    if unavailable {
        // Refused while connecting: nothing was written. redis-rs counts it as a
        // dropped connection too, and so does the lock core's retry at once.
        if error.is_connection_refusal() {
            return StoreError::not_applied(error)
                .and_connection_lost()
                .and_unanswered();
        }
        if error.is_connection_dropped() && !error.is_timeout() {
            return StoreError::connection_lost(error);
        }
        let unanswered = error.is_io_error() || error.is_timeout();
        let error = StoreError::new(StoreErrorKind::Unavailable, error);
        return if unanswered {
            error.and_unanswered()
        } else {
            error
        };
    }
    // A primary demoted to a replica (a Sentinel failover): the backend moves to the new
    // primary, and trying again at once goes there.
    if error.code() == Some("READONLY") {
        return StoreError::connection_lost(error);
    }
    let kind = match error.kind() {
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType => {
            StoreErrorKind::Unexpected
        }
        _ => StoreErrorKind::Misconfigured,
    };
    StoreError::new(kind, error)
}

/// What a server answers while it cannot serve writes, for a while, whoever asks:
/// reading its data back after a restart, another client's script running too long,
/// too few replicas for `min-replicas-to-write`, memory full, a replica cut off from
/// its primary. Each is an outage (retried while waiting, an unlock tried again), not
/// a misconfiguration.
const REFUSED_FOR_NOW: [&str; 5] = ["LOADING", "BUSY", "NOREPLICAS", "OOM", "MASTERDOWN"];

/// Of [`REFUSED_FOR_NOW`], what a server answers when it may no longer be the primary:
/// one cut off from its replicas, which the Sentinels may have replaced by one of them
/// (`NOREPLICAS`), or a replica cut off from its primary (`MASTERDOWN`).
pub(super) const PRIMARY_IN_DOUBT: [&str; 2] = ["NOREPLICAS", "MASTERDOWN"];

/// Whether the server refused the command, or a script's command, with one of
/// [`REFUSED_FOR_NOW`].
fn refused_for_now(error: &RedisError) -> bool {
    refused_with(error, &REFUSED_FOR_NOW)
}

/// Whether the server refused the command, or a script's command, with one of `codes`.
/// A refusal inside the batch script arrives as its text; one in a pipeline (a script
/// and its `WAIT`, with replica acknowledgement) among the pipeline's errors, where
/// redis-rs names the code only of the errors it knows.
pub(super) fn refused_with(error: &RedisError, codes: &[&str]) -> bool {
    let names = |text: &str| {
        let word = text.trim_start_matches(['-', '"']);
        codes.iter().any(|code| {
            word.strip_prefix(code)
                .is_some_and(|rest| rest.starts_with([' ', '"', ':']))
        })
    };
    if error.code().is_some_and(|code| codes.contains(&code)) || error.detail().is_some_and(names) {
        return true;
    }
    error.clone().into_server_errors().is_some_and(|errors| {
        errors
            .iter()
            .any(|(_, e)| codes.contains(&e.code()) || e.details().is_some_and(names))
    })
}

/// The redis-rs error behind one of this crate's, if it has one.
pub(super) fn redis_error_of(error: &Error) -> Option<&RedisError> {
    match error {
        Error::Store(store) => std::error::Error::source(store)?.downcast_ref(),
        _ => None,
    }
}

/// Whether Redis Cluster stopped a script at a command whose key is not served here
/// now ([`moved_away`]) or because the cluster is down. Every name of a lock shares its
/// slot, so neither says anything about the script: the slot is migrating, or the
/// cluster is failing over. The script may have written before it was stopped; the
/// lock core takes back what a failed attempt may have taken, as for any outage.
fn cluster_refused_script(error: &RedisError) -> bool {
    let said = |text: &str| moved_away(text) || text.contains("cluster is down");
    error.detail().is_some_and(said) || said(&error.to_string())
}

/// Whether `message` is Redis Cluster's refusal of a script's command on a key the node
/// does not serve now: in a migrating slot, a key missing from the source is the
/// target's, so a script that deletes a lock there cannot look at it again.
pub(super) fn moved_away(message: &str) -> bool {
    message.contains("non local key")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch operation's refusal, as `lock_batch.lua` returns its text.
    fn in_batch(message: &str) -> RedisError {
        RedisError::from((
            redis::ErrorKind::Extension,
            "lock script error",
            message.to_owned(),
        ))
    }

    #[test]
    fn refusals_for_now_are_outages_and_nothing_like_them_is() {
        for message in [
            "NOREPLICAS Not enough good replicas to write. script: 89, on @user_script:43.",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "\"BUSY\": Redis is busy running a script.",
            "MASTERDOWN Link with MASTER is down",
            "LOADING Redis is loading the dataset in memory",
        ] {
            let kind = store_error(in_batch(message)).kind();
            assert_eq!(kind, StoreErrorKind::Unavailable, "{message}");
        }
        for message in [
            "BUSYGROUP Consumer Group name already exists",
            "ERR OOM in the middle",
            "NOPERM this user has no permissions",
            "user_script:1: Script attempted to access nonexistent global variable",
        ] {
            let kind = store_error(in_batch(message)).kind();
            assert_eq!(kind, StoreErrorKind::Misconfigured, "{message}");
        }
    }

    /// Issue 44, finding 3: the Sentinels naming no primary while they move it was a
    /// misconfiguration (the layer answered 500, releases were given up). It is an
    /// outage, and nothing was sent.
    #[cfg(feature = "sentinel")]
    #[test]
    fn sentinels_naming_no_primary_is_an_outage() {
        for kind in [
            redis::ErrorKind::MasterNameNotFoundBySentinel,
            redis::ErrorKind::NoValidReplicasFoundBySentinel,
        ] {
            let error = store_error(RedisError::from((kind, "no primary now")));
            assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{kind:?}");
            assert!(error.is_not_applied(), "{kind:?}");
        }
    }

    /// What makes a backend behind Sentinel ask where the primary is, found behind
    /// this crate's error as the batch path sees it: only the two refusals of a server
    /// that may no longer be the primary.
    #[test]
    fn a_primary_in_doubt_is_found_behind_the_crates_error() {
        let in_doubt = |message: &str| {
            let error = map_error(in_batch(message));
            redis_error_of(&error).is_some_and(|e| refused_with(e, &PRIMARY_IN_DOUBT))
        };
        assert!(in_doubt(
            "\"NOREPLICAS\": Not enough good replicas to write."
        ));
        assert!(in_doubt("MASTERDOWN Link with MASTER is down"));
        for message in [
            "LOADING Redis is loading the dataset in memory",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "ERR NOREPLICAS in the middle",
        ] {
            assert!(!in_doubt(message), "{message}");
        }
        let wrong = Error::Store(StoreError::new(StoreErrorKind::Misconfigured, WrongType));
        assert!(redis_error_of(&wrong).is_none());
    }
}
