//! `redis+sentinel://` URLs (feature `sentinel`): the Sentinels, the name they monitor
//! the primary under, and the primary's credentials and database in one string, in the
//! form several Redis clients share:
//!
//! ```text
//! redis+sentinel://[user:password@]host[:port][,host[:port]...]/master[/db]
//! ```
//!
//! A host without a port is a Sentinel on 26379; IPv6 addresses go in brackets. User
//! and password (percent-encoded, as in a `redis://` URL, or as they are: everything up
//! to the last `@` is the credentials) and the database are the primary's; Sentinels that want a password of their own are named with
//! [`RedisBackend::sentinel`](super::RedisBackend::sentinel) instead. redis-rs has no
//! parser for this form (1.8), hence this one: it never panics, and its errors name
//! what is wrong without repeating the credentials.
//!
//! [`RedisBackend::from_url`](super::RedisBackend::from_url) takes these URLs;
//! [`SentinelUrl`] is for an application's other connections to the same primary.
//!
//! # Example
//!
//! ```no_run
//! use tower_lock::backend::redis::SentinelUrl;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let url = SentinelUrl::parse("redis+sentinel://:secret@10.0.0.1,10.0.0.2/mymaster/2")?;
//! assert_eq!(url.master(), "mymaster");
//! // A client for the primary the Sentinels name now.
//! let primary = url.sentinel_client()?.async_get_client().await?;
//! # let _ = primary;
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! [`SentinelUrl::parse`] fails with a
//! [misconfigured](crate::StoreErrorKind::Misconfigured) [`Error::Store`].

use percent_encoding::percent_decode_str;

use crate::error::{Error, Result, StoreErrorKind};

/// The port of a Sentinel named without one.
const SENTINEL_PORT: u16 = 26379;

/// What `redis+sentinel://` URLs look like, for error messages.
const FORM: &str = "redis+sentinel://[user:password@]host[:port][,host[:port]...]/master[/db]";

/// A parsed `redis+sentinel://` URL; see the [module docs](self). Its `Debug` shows
/// no password.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelUrl {
    /// The name the Sentinels monitor the primary under.
    master: String,
    /// Each Sentinel, as a `redis://host:port` URL.
    sentinels: Vec<String>,
    /// The primary's user, if any.
    username: Option<String>,
    /// The primary's password, if any.
    password: Option<String>,
    /// The primary's database.
    db: i64,
}

impl std::fmt::Debug for SentinelUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelUrl")
            .field("master", &self.master)
            .field("sentinels", &self.sentinels)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("db", &self.db)
            .finish()
    }
}

impl SentinelUrl {
    /// Parses `url`.
    ///
    /// # Errors
    ///
    /// A [misconfigured](crate::StoreErrorKind::Misconfigured) [`Error::Store`] that
    /// says what is wrong: another scheme, no master name, no Sentinel, an empty host,
    /// a bad port or database, a query string.
    pub fn parse(url: &str) -> Result<Self> {
        Self::parse_reason(url).map_err(|reason| {
            Error::store(
                StoreErrorKind::Misconfigured,
                format!("the Sentinel URL {reason}"),
            )
        })
    }

    /// The name the Sentinels monitor the primary under.
    pub fn master(&self) -> &str {
        &self.master
    }

    /// Each Sentinel, as a `redis://host:port` URL.
    pub fn sentinels(&self) -> &[String] {
        &self.sentinels
    }

    /// The database on the primary (0 unless the URL names one).
    pub fn db(&self) -> i64 {
        self.db
    }

    /// A redis-rs [`SentinelClient`](redis::sentinel::SentinelClient) for the primary:
    /// `async_get_client` asks the Sentinels where it is now.
    ///
    /// # Errors
    ///
    /// When redis-rs refuses a Sentinel's address (a
    /// [misconfigured](crate::StoreErrorKind::Misconfigured) [`Error::Store`]).
    pub fn sentinel_client(&self) -> Result<redis::sentinel::SentinelClient> {
        redis::sentinel::SentinelClient::build(
            self.sentinels.clone(),
            self.master.clone(),
            Some(self.node_info()),
            redis::sentinel::SentinelServerType::Master,
        )
        .map_err(|e| Error::store(StoreErrorKind::Misconfigured, e.to_string()))
    }

    /// Parses `url`; the error says what is wrong with it.
    pub(super) fn parse_reason(url: &str) -> std::result::Result<Self, String> {
        let rest = strip_scheme(url)
            .ok_or_else(|| format!("must start with {}", super::SENTINEL_SCHEME))?;
        // The credentials first, up to the last `@`: a generated password may hold any
        // of `/`, `:`, `?` or `#`, and nothing before the `@` is ever quoted in an error.
        let (userinfo, rest) = match rest.rsplit_once('@') {
            Some((userinfo, rest)) => (Some(userinfo), rest),
            None => (None, rest),
        };
        if rest.contains(['?', '#']) {
            return Err("takes no query string or fragment".into());
        }
        let (hosts, path) = rest
            .split_once('/')
            .ok_or_else(|| format!("names no master (expected {FORM})"))?;
        let (username, password) = match userinfo {
            None => (None, None),
            Some(userinfo) => match userinfo.split_once(':') {
                Some((user, password)) => (decode(user, "user")?, decode(password, "password")?),
                None => (decode(userinfo, "user")?, None),
            },
        };
        if hosts.is_empty() {
            return Err(format!("names no Sentinel (expected {FORM})"));
        }
        let sentinels = hosts
            .split(',')
            .map(sentinel)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut segments = path.split('/');
        let master = segments
            .next()
            .map(|m| decode(m, "master name"))
            .transpose()?
            .flatten()
            .ok_or_else(|| format!("names no master (expected {FORM})"))?;
        let db = match segments.next() {
            None | Some("") => 0,
            Some(db) => db
                .parse::<i64>()
                .ok()
                .filter(|&db| db >= 0)
                .ok_or_else(|| format!("has a database that is not a number from 0 up: {db:?}"))?,
        };
        if segments.any(|s| !s.is_empty()) {
            return Err(format!(
                "has more path than master and database (expected {FORM})"
            ));
        }
        Ok(SentinelUrl {
            master,
            sentinels,
            username,
            password,
            db,
        })
    }

    /// The primary's user, password and database, for redis-rs.
    pub(super) fn node_info(&self) -> redis::sentinel::SentinelNodeConnectionInfo {
        let mut info = redis::RedisConnectionInfo::default().set_db(self.db);
        if let Some(username) = &self.username {
            info = info.set_username(username);
        }
        if let Some(password) = &self.password {
            info = info.set_password(password);
        }
        redis::sentinel::SentinelNodeConnectionInfo::default().set_redis_connection_info(info)
    }
}

/// `url` after its scheme (in any case), if that is `redis+sentinel://`.
fn strip_scheme(url: &str) -> Option<&str> {
    let scheme = super::SENTINEL_SCHEME;
    url.get(..scheme.len())
        .filter(|s| s.eq_ignore_ascii_case(scheme))
        .and_then(|_| url.get(scheme.len()..))
}

/// A percent-decoded part of the URL; `None` when empty.
fn decode(part: &str, what: &str) -> std::result::Result<Option<String>, String> {
    let decoded = percent_decode_str(part)
        .decode_utf8()
        .map_err(|_| format!("has a {what} that is not UTF-8 once percent-decoded"))?;
    Ok((!decoded.is_empty()).then(|| decoded.into_owned()))
}

/// One `host[:port]` of the Sentinel list, as a `redis://` URL.
fn sentinel(host_port: &str) -> std::result::Result<String, String> {
    let (host, port) = if let Some(bracketed) = host_port.strip_prefix('[') {
        let (v6, after) = bracketed
            .split_once(']')
            .ok_or_else(|| format!("has an unclosed IPv6 bracket in {host_port:?}"))?;
        let port = match after {
            "" => None,
            after => Some(after.strip_prefix(':').ok_or_else(|| {
                format!("has something other than :port after an IPv6 address in {host_port:?}")
            })?),
        };
        (format!("[{v6}]"), port)
    } else {
        match host_port.split_once(':') {
            Some((_, port)) if port.contains(':') => {
                return Err(format!(
                    "has an IPv6 address without brackets: {host_port:?} (write [addr]:port)"
                ));
            }
            Some((host, port)) => (host.to_owned(), Some(port)),
            None => (host_port.to_owned(), None),
        }
    };
    let bad = |c: char| c.is_whitespace() || c.is_control() || "/@?#[]".contains(c);
    if host.is_empty() || host == "[]" {
        return Err(format!("has an empty Sentinel host (expected {FORM})"));
    }
    if host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .contains(bad)
    {
        return Err(format!(
            "has a Sentinel host that is not a host name: {host:?}"
        ));
    }
    let port = match port {
        None => SENTINEL_PORT,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| format!("has a Sentinel port that is not 1 to 65535: {port:?}"))?,
    };
    Ok(format!("redis://{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> std::result::Result<SentinelUrl, String> {
        SentinelUrl::parse_reason(url)
    }

    #[test]
    fn the_full_form() {
        let url =
            parse("redis+sentinel://app:s%40cret@10.0.0.1:26380,sentinel-2,[::1]:5000/mymaster/3")
                .unwrap();
        assert_eq!(
            url,
            SentinelUrl {
                master: "mymaster".into(),
                sentinels: vec![
                    "redis://10.0.0.1:26380".into(),
                    "redis://sentinel-2:26379".into(),
                    "redis://[::1]:5000".into(),
                ],
                username: Some("app".into()),
                password: Some("s@cret".into()),
                db: 3,
            }
        );
        // Every Sentinel URL is one redis-rs accepts.
        for sentinel in &url.sentinels {
            redis::Client::open(sentinel.as_str()).unwrap();
        }
        url.sentinel_client().unwrap();
        let debug = format!("{url:?}");
        assert!(!debug.contains("s@cret"), "{debug}");
    }

    /// Issue 49, finding 4: a password holding `/` or `:` was split as the host and
    /// path, and quoted in the error (`has a Sentinel port that is not 1 to 65535:
    /// "Zx81"`). The credentials are everything up to the last `@`, and no error, nor
    /// the parsed URL's `Debug`, repeats any of them, however the rest is malformed.
    #[test]
    fn no_error_repeats_a_password() {
        let secrets = [
            "Zx81/kQ9+w",
            "qZ7x:Y9v/pW4k?Tr3#Hj2",
            "pQ7s@sWw9/wR6d:d9Kx",
            "sE4k%2FcrQ7%3At",
        ];
        let malformed = [
            "{}@10.0.0.1/mymaster",
            "{}@10.0.0.1:notaport/mymaster",
            "{}@10.0.0.1:0/mymaster",
            "{}@/mymaster",
            "{}@10.0.0.1",
            "{}@10.0.0.1/mymaster/nodb",
            "{}@10.0.0.1/mymaster/1/extra",
            "{}@10.0.0.1/mymaster?x=1",
            "{}@[::1/mymaster",
            "{}@::1:5/mymaster",
            "{}@host name/mymaster",
            "{}@10.0.0.1,,10.0.0.2/mymaster",
            "{}@10.0.0.1/%FF",
        ];
        for secret in secrets {
            for form in malformed {
                for userinfo in [format!(":{secret}"), format!("app:{secret}")] {
                    let url = format!("redis+sentinel://{}", form.replace("{}", &userinfo));
                    let shown = match SentinelUrl::parse(&url) {
                        Ok(parsed) => format!("{parsed:?}"),
                        Err(error) => format!("{error} {error:?}"),
                    };
                    for part in secret.split(['/', ':', '?', '#', '@', '%']) {
                        if part.len() >= 4 {
                            assert!(!shown.contains(part), "{url}: {shown}");
                        }
                    }
                }
            }
        }
        let url = parse("redis+sentinel://app:Zx81/kQ9+w@10.0.0.1/mymaster").unwrap();
        assert_eq!(url.password.as_deref(), Some("Zx81/kQ9+w"));
        assert_eq!(url.sentinels, ["redis://10.0.0.1:26379"]);
    }

    #[test]
    fn the_short_forms() {
        let url = parse("REDIS+SENTINEL://localhost/mymaster").unwrap();
        assert_eq!(url.sentinels, ["redis://localhost:26379"]);
        assert_eq!((url.master.as_str(), url.db), ("mymaster", 0));
        assert_eq!((url.username, url.password), (None, None));
        assert_eq!(parse("redis+sentinel://h/m/").unwrap().db, 0);
        let password_only = parse("redis+sentinel://:pw@h/m").unwrap();
        assert_eq!(
            (password_only.username, password_only.password.as_deref()),
            (None, Some("pw"))
        );
        let user_only = parse("redis+sentinel://u@h/m").unwrap();
        assert_eq!(
            (user_only.username.as_deref(), user_only.password),
            (Some("u"), None)
        );
        assert_eq!(
            parse("redis+sentinel://[::1]/m").unwrap().sentinels,
            ["redis://[::1]:26379"]
        );
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, says) in [
            ("redis://h:26379/m", "must start with redis+sentinel://"),
            ("redis+sentinel://h:26379", "names no master"),
            ("redis+sentinel://h:26379/", "names no master"),
            ("redis+sentinel:///m", "names no Sentinel"),
            ("redis+sentinel://u:p@/m", "names no Sentinel"),
            ("redis+sentinel://h1,,h2/m", "empty Sentinel host"),
            ("redis+sentinel://h:/m", "port that is not 1 to 65535"),
            ("redis+sentinel://h:0/m", "port that is not 1 to 65535"),
            ("redis+sentinel://h:65536/m", "port that is not 1 to 65535"),
            ("redis+sentinel://h:x/m", "port that is not 1 to 65535"),
            ("redis+sentinel://::1/m", "IPv6 address without brackets"),
            ("redis+sentinel://[::1/m", "unclosed IPv6 bracket"),
            ("redis+sentinel://[::1]x/m", "after an IPv6 address"),
            ("redis+sentinel://[]:1/m", "empty Sentinel host"),
            ("redis+sentinel://h h/m", "not a host name"),
            ("redis+sentinel://h/m/x", "not a number from 0 up"),
            ("redis+sentinel://h/m/-1", "not a number from 0 up"),
            ("redis+sentinel://h/m/0/x", "more path"),
            ("redis+sentinel://h/m?db=1", "no query string"),
            ("redis+sentinel://h/m#x", "no query string"),
            ("redis+sentinel://u:%FF@h/m", "password that is not UTF-8"),
            ("", "must start with"),
            ("redis+sentinel:/", "must start with"),
            ("redis+sentinel://", "names no master"),
        ] {
            let err = parse(url).expect_err(url);
            assert!(err.contains(says), "{url}: {err}");
        }
    }

    #[test]
    fn errors_never_repeat_the_password() {
        for url in [
            "redis+sentinel://u:hunter2@h:x/m",
            "redis+sentinel://u:hunter2@h/m/x",
            "redis+sentinel://u:hunter2@h",
        ] {
            let err = parse(url).expect_err(url);
            assert!(!err.contains("hunter2"), "{url}: {err}");
        }
    }

    #[test]
    fn no_input_panics() {
        // Every prefix and a few mutations of a full URL, at every char boundary.
        let full = "redis+sentinel://ü:p@[::1]:1,h:2/m/1";
        for (i, _) in full.char_indices() {
            let _ = parse(&full[..i]);
            let _ = parse(&full[i..]);
            for c in ['/', ':', '@', ',', '[', ']', '%'] {
                let _ = parse(&format!("{}{c}{}", &full[..i], &full[i..]));
            }
        }
    }
}
