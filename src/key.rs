//! Validated lock keys.
//!
//! A [`LockKey`] is the name of one lock. It is validated once, when it is made, so a
//! backend never sees an empty key, a key longer than [`MAX_KEY_LEN`] bytes, control
//! characters, or braces that would put a lock's companion keys (fencing counter, fair
//! queue, release channel) in a different Redis Cluster slot than the lock itself.
//!
//! Keys derived from user input should be built with [`LockKey::namespaced`], which puts
//! the user part inside a hash tag (`lock:order:{42}`) and escapes whatever could break
//! out of it, so a crafted header can neither reach another namespace nor split a lock
//! across cluster slots.
//!
//! # Example
//!
//! ```
//! use tower_lock::LockKey;
//!
//! let key = LockKey::new("anyLock")?;
//! assert_eq!(key.as_str(), "anyLock");
//!
//! // User-controlled text is escaped inside a hash tag:
//! let key = LockKey::namespaced("lock:order", "42")?;
//! assert_eq!(key.as_str(), "lock:order:{42}");
//! let key = LockKey::namespaced("lock:order", "x}:evil{")?;
//! assert_eq!(key.as_str(), "lock:order:{x%7D:evil%7B}");
//! assert_eq!(key.hash_tag(), Some("x%7D:evil%7B"));
//!
//! assert!(LockKey::new("").is_err());
//! assert!(LockKey::new("a{b}c{d}").is_err());
//! # Ok::<(), tower_lock::Error>(())
//! ```
//!
//! # Errors
//!
//! Every constructor returns [`ConfigError::InvalidKey`](crate::ConfigError::InvalidKey) with the
//! reason; nothing here panics on any input.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

use crate::error::ConfigError;

type Result<T, E = ConfigError> = std::result::Result<T, E>;
use crate::namespace::Namespace;

/// The longest key accepted, in bytes (1 KiB). Redis allows far longer keys, but every
/// lock operation sends the key, and a key this long is almost always a bug (a whole
/// request body used as a key).
pub const MAX_KEY_LEN: usize = 1024;

/// The beginnings of the names a lock's companion keys take (on Redis: the fencing
/// counter, the release channel, the wait queue, the read-write lock's keys, the
/// permits, the stored responses, the client names; Redisson's and the crate's own).
/// A lock key or namespace that starts with one could be another lock's companion, so
/// none may.
pub const RESERVED_PREFIXES: [&str; 8] = [
    "redisson_lock__channel:",
    "redisson_lock_token:",
    "redisson_lock_queue:",
    "redisson_lock_timeout:",
    "redisson_rwlock:",
    "tower_lock_permits:",
    "tower_lock_replay:",
    "tower_lock_client:",
];

/// Whether `name` (a key, or a namespace with its joining `:`) begins like a companion
/// key: the reason it may not, if so.
pub(crate) fn check_not_reserved(name: &str) -> std::result::Result<(), String> {
    match RESERVED_PREFIXES.iter().find(|p| name.starts_with(*p)) {
        Some(prefix) => Err(format!(
            "names starting with `{prefix}` are kept for the locks' companion keys"
        )),
        None => Ok(()),
    }
}

/// The name of one lock: non-empty, at most [`MAX_KEY_LEN`] bytes, no control
/// characters, and either no braces or exactly one non-empty hash tag `{...}`.
///
/// Cheap to clone (an `Arc<str>` inside).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(Arc<str>);

impl LockKey {
    /// Validates `key` as a lock name.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`](crate::ConfigError::InvalidKey) when the key is empty, longer than [`MAX_KEY_LEN`] bytes,
    /// contains a control character, has braces other than one non-empty `{tag}`, or
    /// starts like a companion key ([`RESERVED_PREFIXES`]).
    pub fn new(key: impl AsRef<str>) -> Result<Self> {
        let key = key.as_ref();
        validate(key)?;
        Ok(LockKey(Arc::from(key)))
    }

    /// Builds `<namespace>:{<part>}` from a fixed namespace and a value that may come
    /// from a user (a header, a path segment, a user id).
    ///
    /// `part` is wrapped in a hash tag, so every companion key of the lock lands in the
    /// same Redis Cluster slot, and `%`, `{`, `}` and control characters in it are
    /// percent-escaped, so it can neither close the tag nor inject another one. The
    /// escaping is one-to-one: different parts give different keys. An empty namespace
    /// gives `{<part>}`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`](crate::ConfigError::InvalidKey) when `namespace` breaks the [`Namespace`] rule (longer than
    /// [`MAX_NAMESPACE_LEN`](crate::MAX_NAMESPACE_LEN) bytes, braces, control
    /// characters, a `:` at either end or two in a row), `part` is empty, or the result
    /// is longer than [`MAX_KEY_LEN`] bytes.
    pub fn namespaced(namespace: &str, part: &str) -> Result<Self> {
        crate::namespace::check(namespace)
            .map_err(|reason| ConfigError::invalid_key(format!("namespace {reason}")))?;
        Self::build_namespaced(namespace, part)
    }

    /// [`LockKey::namespaced`] in a namespace already checked.
    pub(crate) fn in_namespace(namespace: &Namespace, part: &str) -> Result<Self> {
        Self::build_namespaced(namespace.as_str(), part)
    }

    fn build_namespaced(namespace: &str, part: &str) -> Result<Self> {
        if part.is_empty() {
            return Err(ConfigError::invalid_key("key part is empty"));
        }
        let key = crate::scratch::arc_str(|key| {
            if !namespace.is_empty() {
                key.push_str(namespace);
                key.push(':');
            }
            key.push('{');
            escape_into(part, key);
            key.push('}');
        });
        // Valid by construction (one non-empty tag, no control characters: the namespace
        // was checked and the part escaped); only the length is left to check.
        if key.len() > MAX_KEY_LEN {
            return Err(ConfigError::invalid_key(format!(
                "key is {} bytes long, the limit is {MAX_KEY_LEN}",
                key.len()
            )));
        }
        debug_assert!(
            validate(&key).is_ok(),
            "namespaced built an invalid key: {key:?}"
        );
        Ok(LockKey(key))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key's namespace: the part before its hash tag (`lock:order:{42}` →
    /// `lock:order`), else the part before its last `:` (`account:17` → `account`);
    /// empty for a key with neither (`anyLock`). For metric labels and log fields:
    /// unlike the key, it does not grow with the number of users — as long as keys put
    /// user input in the hash tag ([`LockKey::namespaced`]) or after the last `:`.
    ///
    /// ```
    /// use tower_lock::LockKey;
    ///
    /// assert_eq!(LockKey::namespaced("lock:order", "42")?.namespace(), "lock:order");
    /// assert_eq!(LockKey::new("account:17")?.namespace(), "account");
    /// assert_eq!(LockKey::new("anyLock")?.namespace(), "");
    /// # Ok::<(), tower_lock::Error>(())
    /// ```
    pub fn namespace(&self) -> &str {
        let key = self.as_str();
        let head = match key.find('{') {
            Some(open) => &key[..open],
            None => key.rfind(':').map_or("", |colon| &key[..colon]),
        };
        head.trim_end_matches(':')
    }

    /// The hash tag's content when the key has one (`lock:{42}` → `42`).
    pub fn hash_tag(&self) -> Option<&str> {
        let open = self.0.find('{')?;
        let close = self.0[open..].find('}')? + open;
        Some(&self.0[open + 1..close])
    }
}

fn validate(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(ConfigError::invalid_key("key is empty"));
    }
    check_not_reserved(key).map_err(ConfigError::invalid_key)?;
    if key.len() > MAX_KEY_LEN {
        return Err(ConfigError::invalid_key(format!(
            "key is {} bytes long, the limit is {MAX_KEY_LEN}",
            key.len()
        )));
    }
    if let Some(c) = key.chars().find(|c| c.is_control()) {
        return Err(ConfigError::invalid_key(format!(
            "key contains the control character {c:?}"
        )));
    }
    let opens = key.matches('{').count();
    let closes = key.matches('}').count();
    match (opens, closes) {
        (0, 0) => Ok(()),
        (1, 1) => {
            let open = key.find('{').unwrap_or(0);
            let close = key.find('}').unwrap_or(0);
            if close < open {
                Err(ConfigError::invalid_key("`}` comes before `{`"))
            } else if close == open + 1 {
                Err(ConfigError::invalid_key("hash tag `{}` is empty"))
            } else {
                Ok(())
            }
        }
        _ => Err(ConfigError::invalid_key(
            "a key may hold at most one hash tag `{...}`; escape user input with LockKey::namespaced",
        )),
    }
}

/// Appends `part` with `%`, `{`, `}` and control characters (`char::is_control`, the
/// C1 controls such as U+0085 included) percent-escaped, `%XX` per UTF-8 byte in
/// uppercase hex; everything else, other non-ASCII text included, is kept as it is.
///
/// The output must never change: replicas of two versions mid-rollout have to build the
/// same key for the same user, or they would not exclude each other. That is why this
/// escapes char by char with `percent_encode_byte` rather than `utf8_percent_encode`
/// with an `AsciiSet`, which would escape every non-ASCII byte.
fn escape_into(part: &str, out: &mut String) {
    let mut kept = 0;
    for (at, c) in part.char_indices() {
        if matches!(c, '%' | '{' | '}') || c.is_control() {
            out.push_str(&part[kept..at]);
            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                out.push_str(percent_encoding::percent_encode_byte(b));
            }
            kept = at + c.len_utf8();
        }
    }
    out.push_str(&part[kept..]);
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for LockKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for LockKey {
    type Error = ConfigError;
    fn try_from(value: &str) -> Result<Self> {
        LockKey::new(value)
    }
}

impl TryFrom<String> for LockKey {
    type Error = ConfigError;
    fn try_from(value: String) -> Result<Self> {
        LockKey::new(value)
    }
}

impl std::str::FromStr for LockKey {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self> {
        LockKey::new(s)
    }
}

/// Anything that can become a [`LockKey`]: text (validated) or a key.
pub trait IntoLockKey {
    /// Converts, validating text.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`](crate::ConfigError::InvalidKey) for text that is not a valid key.
    fn into_lock_key(self) -> Result<LockKey>;
}

impl IntoLockKey for LockKey {
    fn into_lock_key(self) -> Result<LockKey> {
        Ok(self)
    }
}

impl IntoLockKey for &LockKey {
    fn into_lock_key(self) -> Result<LockKey> {
        Ok(self.clone())
    }
}

impl IntoLockKey for &str {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}

impl IntoLockKey for String {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}

impl IntoLockKey for &String {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_tagged_keys() {
        for ok in [
            "a",
            "anyLock",
            "lock:order:42",
            "lock:{42}:order",
            "{x}",
            "é✓",
        ] {
            assert_eq!(LockKey::new(ok).unwrap().as_str(), ok);
        }
        assert_eq!(
            LockKey::new("x".repeat(MAX_KEY_LEN))
                .unwrap()
                .as_str()
                .len(),
            MAX_KEY_LEN
        );
    }

    #[test]
    fn rejects_bad_keys_with_reasons() {
        let cases = [
            ("", "empty"),
            ("a\nb", "control"),
            ("a\u{7f}", "control"),
            ("{}", "empty"),
            ("}a{", "before"),
            ("{a}{b}", "at most one"),
            ("a{b", "at most one"),
            ("a}b", "at most one"),
        ];
        for (key, why) in cases {
            match LockKey::new(key) {
                Err(ConfigError::InvalidKey { reason }) => {
                    assert!(reason.contains(why), "{key:?}: {reason}")
                }
                other => panic!("{key:?}: {other:?}"),
            }
        }
        assert!(matches!(
            LockKey::new("x".repeat(MAX_KEY_LEN + 1)),
            Err(ConfigError::InvalidKey { .. })
        ));
    }

    #[test]
    fn namespaced_escapes_user_text() {
        let key = LockKey::namespaced("lock:order", "42").unwrap();
        assert_eq!(key.as_str(), "lock:order:{42}");
        assert_eq!(key.hash_tag(), Some("42"));

        let key = LockKey::namespaced("ns", "a}b{c%d\n").unwrap();
        assert_eq!(key.as_str(), "ns:{a%7Db%7Bc%25d%0A}");
        assert_eq!(LockKey::namespaced("", "u").unwrap().as_str(), "{u}");

        // One-to-one: the escape character itself is escaped.
        assert_ne!(
            LockKey::namespaced("ns", "%7D").unwrap(),
            LockKey::namespaced("ns", "}").unwrap()
        );
    }

    /// Pins the escaping byte for byte: replicas of two versions mid-rollout must build
    /// the same key for the same user part, or they would not exclude each other.
    #[test]
    fn namespaced_keys_are_stable_across_versions() {
        let corpus = [
            (
                "plain-ASCII_42:user@example.com",
                "plain-ASCII_42:user@example.com",
            ),
            (" +/?&=#!~*'()[];,\\\"", " +/?&=#!~*'()[];,\\\""),
            ("%{}", "%25%7B%7D"),
            ("%7D", "%257D"),
            ("a}b{c%d", "a%7Db%7Bc%25d"),
            ("a\tb\nc\r\0", "a%09b%0Ac%0D%00"),
            ("\u{1b}[0m\u{7f}", "%1B[0m%7F"),
            ("x\u{85}y", "x%C2%85y"),
            ("\u{80}\u{9f}", "%C2%80%C2%9F"),
            (
                "\u{a0}\u{ad}\u{200b}\u{2028}\u{feff}",
                "\u{a0}\u{ad}\u{200b}\u{2028}\u{feff}",
            ),
            ("é✓ß", "é✓ß"),
            ("🔒😀👩‍👩‍👧", "🔒😀👩‍👩‍👧"),
            ("用户42", "用户42"),
            ("日本{語}\t🔑%", "日本%7B語%7D%09🔑%25"),
        ];
        for (part, escaped) in corpus {
            let key = LockKey::namespaced("ns", part).unwrap();
            assert_eq!(key.as_str(), format!("ns:{{{escaped}}}"), "{part:?}");
            assert_eq!(key.hash_tag(), Some(escaped), "{part:?}");
        }

        // And every char, against the rule itself: `%`, `{`, `}` and control characters
        // become `%XX` per UTF-8 byte (uppercase hex), anything else stays as it is.
        let mut out = String::new();
        let mut want = String::new();
        for c in (0..=u32::from(char::MAX)).filter_map(char::from_u32) {
            out.clear();
            want.clear();
            escape_into(c.encode_utf8(&mut [0; 4]), &mut out);
            if matches!(c, '%' | '{' | '}') || c.is_control() {
                for b in c.encode_utf8(&mut [0; 4]).bytes() {
                    want.push_str(&format!("%{b:02X}"));
                }
            } else {
                want.push(c);
            }
            assert_eq!(out, want, "{c:?}");
        }
    }

    #[test]
    fn namespaced_rejects_bad_parts() {
        assert!(LockKey::namespaced("ns", "").is_err());
        assert!(LockKey::namespaced("n{s", "a").is_err());
        assert!(LockKey::namespaced("n\ts", "a").is_err());
        let long = "n".repeat(crate::MAX_NAMESPACE_LEN + 1);
        assert!(matches!(
            LockKey::namespaced(&long, "a"),
            Err(ConfigError::InvalidKey { reason }) if reason.starts_with("namespace must be at most")
        ));
        assert!(LockKey::namespaced("ns", &"}".repeat(400)).is_err());
    }

    #[test]
    fn into_lock_key_variants() {
        let key = LockKey::new("k").unwrap();
        assert_eq!("k".into_lock_key().unwrap(), key);
        assert_eq!(String::from("k").into_lock_key().unwrap(), key);
        assert_eq!((&key).into_lock_key().unwrap(), key);
        assert!("".into_lock_key().is_err());
    }
}
